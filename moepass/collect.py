"""Where the backend's records go: the innermost `collecting()` report, else the report of the torch.compile
call being compiled (`last_report()`: the latest such call's graphs; `torch._dynamo.reset()` clears it)."""

from __future__ import annotations

import contextlib

from torch._dynamo.utils import counters

from .report import Report

_stack: list[Report] = []
_last: Report | None = None
_last_compile_call: object = None


def current_report(config, compile_call=None) -> Report:
    """The report a graph compiled now belongs to. `compile_call` identifies the torch.compile call (its
    backend wrapper) so that graphs of one compiled model gather in one report and another model's or another
    compile's graphs start a new one; None when unknown (then equal options mean the same report)."""
    global _last, _last_compile_call
    if _stack:
        if not _stack[-1].config:
            _stack[-1].config = config.to_dict()
        return _stack[-1]
    same_call = compile_call is _last_compile_call if compile_call is not None else \
        _last is not None and _last.config == config.to_dict()
    if _last is None or not same_call:
        _last, _last_compile_call = Report(config.to_dict()), compile_call
    return _last


def forget() -> None:
    """Drop the process-wide report (Dynamo's reset calls this: what it described was compiled away)."""
    global _last, _last_compile_call
    _last, _last_compile_call = None, None


def last_report() -> Report | None:
    """The report of the most recent torch.compile(..., backend="moepass") call's graphs, or the innermost
    `collecting()` report (None before any)."""
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


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks Dynamo split a frame at, frames it gave up on and ran in eager) so far in this process.
    A graph break it cannot split at (inside an activation-checkpointed layer, in a loop) skips the frame: its
    GEMMs never reach moepass and stay BF16, and `counters["graph_break"]` does not count it."""
    frames = counters["frames"]
    return sum(counters["graph_break"].values()), frames["total"] - frames["ok"]


@contextlib.contextmanager
def collecting(report: Report | None = None):
    """Gather the records of every graph compiled by moepass inside the block, and Dynamo's graph breaks."""
    report = report if report is not None else Report()
    _stack.append(report)
    breaks, eager = dynamo_counts()
    global _last
    try:
        yield report
    finally:
        _stack.pop()
        breaks_now, eager_now = dynamo_counts()
        report.graph_breaks += breaks_now - breaks
        report.frames_eager += eager_now - eager
        _last = report
