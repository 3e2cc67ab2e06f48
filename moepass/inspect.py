"""`moepass.inspect(model, *args)`: compile once with moepass, run, return what each pass did."""

from __future__ import annotations

import torch

from .report.collect import collecting
from .options import Config
from .report.records import Report


def inspect(model, *example_args, options: dict | None = None, **example_kwargs) -> Report:
    """Compile `model` with the moepass backend, run it once on the example inputs, return the Report.

    The forward graphs are rewritten and compiled exactly as in training; nothing is run backward.
    """
    config = Config.from_options(options)  # fail fast, before any tracing
    compiled = torch.compile(model, backend="moepass", options=dict(options or {}))
    with collecting(Report(config.to_dict())) as report:  # counts the graph breaks and frames run eagerly
        compiled(*example_args, **example_kwargs)
    return report
