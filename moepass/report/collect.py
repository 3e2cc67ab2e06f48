"""Where the backend's records go: the innermost `collecting()` report, else the run's report.

The run is every graph moepass compiled in this process since the last `torch._dynamo.reset()` (or since
import), whatever torch.compile call compiled it: one call on a whole model, or torchtitan's call per
transformer block and another for the loss. Its report groups the graphs by compile call, and keeps each call's
options; `last_report()` returns it, and every `report_dir` one of its calls named holds all of it.
`torch._dynamo.reset()` ends the run (what it described was compiled away); `collecting()` takes the graphs
compiled inside it into a report of its own instead. The run's graph breaks are Dynamo's count since it began.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import NamedTuple

from torch._dynamo.utils import counters

from .records import GraphOrigin, GraphRecord, Report

log = logging.getLogger(__name__)


class DynamoCounts(NamedTuple):
    """Dynamo's counts at one reading. A graph break it cannot split at (inside an activation-checkpointed
    layer, in a loop) skips the frame: its GEMMs never reach moepass and stay BF16, and is counted as a frame run
    eagerly, not as a graph break."""
    graph_breaks: int  # graph breaks Dynamo split a frame at, so far in this process
    frames_eager: int  # frames it gave up on and ran in eager
    read_from: tuple  # the Counters each was read from: `counters.clear()` (torch's own tests do it) replaces them


def dynamo_counts() -> DynamoCounts:
    frames, breaks = counters["frames"], counters["graph_break"]
    return DynamoCounts(sum(breaks.values()), frames["total"] - frames["ok"], (breaks, frames))


def counted_since(before: DynamoCounts) -> tuple[int, int, DynamoCounts]:
    """(graph breaks, frames run eagerly) Dynamo counted since the reading `before`, and the reading now. After a
    clear of its counters in between, what it counted since the clear (the rest is lost), never a negative count.
    Each count is judged on its own: mid-compile, the frames count holds the frame being compiled for a while."""
    now = dynamo_counts()
    since = [n if counter is not was or n < b else n - b
             for n, b, counter, was in zip(now[:2], before[:2], now.read_from, before.read_from)]
    return since[0], since[1], now


_stack: list[Report] = []
_run: Report | None = None  # the run's report
_last: Report | None = None  # what last_report() returns outside collecting(): the run, or a collecting() report
# the run's graph breaks: it begins at import, and again at each torch._dynamo.reset(); counted reading by
# reading (`_seen` is the last), so that a clear of Dynamo's counters in between loses no more than it must
_run_breaks, _seen = 0, dynamo_counts()


def current_report(config, compile_call=None) -> Report:
    """The report a graph compiled now belongs to, told where that graph comes from. `compile_call`
    identifies the torch.compile call (its backend wrapper), so that the report groups graphs by call; None when
    unknown (those graphs form one group)."""
    global _run, _last
    if _stack:
        report = _stack[-1]
        if not report.config:
            report.config = config.to_dict()
    else:
        if _run is None:
            _run = Report(config.to_dict())  # the run's options are its first call's; index() shows the others'
        report = _last = _counted(_run)
        _end_at_dynamo_reset()
    report.expect(GraphOrigin(compile_call, config.to_dict(), *_dynamo_frame()))
    return report


def _dynamo_frame() -> tuple[str, str]:
    """(Dynamo's compile id, "function (file:line)" of the frame it traced), or blanks outside a Dynamo trace."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._guards import CompileContext

        compile_id = CompileContext.current_compile_id()
        code = InstructionTranslator.current_tx().f_code
        frame = f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})"
        return (str(compile_id) if compile_id is not None else ""), frame
    except Exception:  # internal APIs: a label is not worth failing a compile over
        return "", ""


def _this_ranks(directory: str) -> str:
    """Under torch.distributed with several ranks each rank compiles (and reports) its own graphs: rank<r>/."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return os.path.join(directory, f"rank{dist.get_rank()}")
    return directory


def save_graph(report: Report, graph: GraphRecord) -> None:
    """Write `graph`'s files and the report's totals to every report_dir its compile calls named. A problem
    writing is a warning: a report never fails a compile."""
    for directory in map(_this_ranks, report.report_dirs()):
        try:
            report.save(directory, changed=[graph])
        except Exception as e:
            log.warning("moepass: could not write the report to %s (%s: %s); compiling on", directory,
                        type(e).__name__, e)


def forget() -> None:
    """End the run (Dynamo's reset calls this: what it described was compiled away)."""
    global _run, _last, _run_breaks, _seen
    _run, _last, _run_breaks, _seen = None, None, 0, dynamo_counts()


class _RunEnd:
    """Held among Dynamo's backends so that every torch._dynamo.reset() ends the run."""

    def reset(self) -> None:
        forget()


_RUN_END = _RunEnd()


def _end_at_dynamo_reset() -> None:
    """torch._dynamo.reset() calls reset() on the backends it holds, but holds a compile call's backend only
    from its torch.compile() to the next reset: a model compiled before an earlier reset would not end the run."""
    from torch._dynamo import eval_frame

    held = getattr(eval_frame, "cached_backends", None)  # internal (torch 2.11-2.13): without it, forget() is all
    if held is not None:
        held.setdefault(id(_RUN_END), _RUN_END)


def _counted(run: Report) -> Report:
    """The run with the graph breaks Dynamo split frames at since it began (any backend's). Frames run eagerly
    are counted by `collecting()` only: mid-compile, Dynamo's count holds the frame being compiled."""
    global _run_breaks, _seen
    breaks, _, _seen = counted_since(_seen)
    _run_breaks += breaks
    run.graph_breaks = _run_breaks
    return run


def last_report() -> Report | None:
    """The innermost `collecting()` report; else the run's report (every graph since the last
    `torch._dynamo.reset()`), or the `collecting()` report that ended after the run's latest graph; None
    before any."""
    if _stack:
        return _stack[-1]
    return _counted(_last) if _last is not None and _last is _run else _last


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
    """Gather the records of every graph compiled by moepass inside the block, and Dynamo's graph breaks."""
    report = report if report is not None else Report()
    _stack.append(report)
    before = dynamo_counts()
    global _last
    try:
        yield report
    finally:
        _stack.pop()
        breaks, eager, _ = counted_since(before)
        report.graph_breaks += breaks
        report.frames_eager += eager
        _last = report
