"""moepass: a torch.compile backend that rewrites MoE training graphs for speed.

    model = torch.compile(model, backend="moepass")           # MXFP8 GEMMs, DeepEP dispatch/combine
    report = moepass.inspect(model, tokens)                   # what each pass rewrote, and why not
"""

from . import ops  # noqa: F401  (first: every op and built-in recipe registered for any `import moepass.<anything>`)
from .report.collect import collecting, last_report
from .inspect import inspect
from .options import PIPELINE, Config, OptionsError
from .report.records import Report

__all__ = ["inspect", "collecting", "last_report", "Report", "Config", "OptionsError", "OPTIONS", "PIPELINE"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "OPTIONS":  # read when asked: the table lists the recipes registered by then
        from .options import options_table

        return options_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
