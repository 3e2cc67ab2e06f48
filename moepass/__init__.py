"""moepass: a torch.compile backend that rewrites MoE training graphs for speed.

    model = torch.compile(model, backend="moepass")           # MXFP8 GEMMs, DeepEP dispatch/combine
    report = moepass.inspect(model, tokens)                   # what each pass rewrote, and why not
"""

from .report.collect import collecting, last_report
from .inspect import inspect
from .options import OPTIONS, PIPELINE, Config, OptionsError
from .report.records import Report

__all__ = ["inspect", "collecting", "last_report", "Report", "Config", "OptionsError", "OPTIONS", "PIPELINE"]
__version__ = "0.1.0"
