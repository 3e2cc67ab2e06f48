"""Where the backend's records go: the innermost `collecting()` report, else the process-wide last one."""

from __future__ import annotations

import contextlib

from .report import Report

_stack: list[Report] = []
_last: Report | None = None


def current_report(config) -> Report:
    global _last
    if _stack:
        if not _stack[-1].config:
            _stack[-1].config = config.to_dict()
        return _stack[-1]
    if _last is None or _last.config != config.to_dict():
        _last = Report(config.to_dict())
    return _last


def last_report() -> Report | None:
    """The report of graphs compiled outside `moepass.inspect` (None before any)."""
    return _stack[-1] if _stack else _last


def reporting_runs(compiled_fn, record):
    """Wrap a compiled graph so that running it inside `collecting()` adds its record to that report even
    when Dynamo serves it from its cache without calling the backend (a model compiled earlier)."""

    def run(*args):
        if _stack:
            _stack[-1].add_graph(record, replayed=True)
        return compiled_fn(*args)

    run._boxed_call = getattr(compiled_fn, "_boxed_call", False)  # keep Dynamo's calling convention
    return run


@contextlib.contextmanager
def collecting(report: Report | None = None):
    """Gather the records of every graph compiled by moepass inside the block."""
    report = report if report is not None else Report()
    _stack.append(report)
    global _last
    try:
        yield report
    finally:
        _stack.pop()
        _last = report
