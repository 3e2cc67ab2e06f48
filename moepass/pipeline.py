"""Runs the enabled passes, in pipeline order, on one Dynamo graph and records what each did.

A pass is a module under `moepass.passes` named like its pass, exposing
`NAME`, `SUMMARY` and `run(gm, example_inputs, config, record) -> None`; the pipeline order
is data (`moepass.options.PIPELINE`), never control flow here.
"""

from __future__ import annotations

import importlib
import logging
import time

from torch import fx

from . import coverage, module_paths, sac_policy, torch_logs
from .analysis.fsdp import weights_sharded
from .analysis.scopes import graph_scopes
from .graph import op_histogram
from .options import PIPELINE, Config, canonical_pass
from .report import GraphRecord, PassRecord

log = logging.getLogger(__name__)


def load_pass(name: str):
    """The pass module for a pass name (or an old name of one)."""
    if canonical_pass(name) not in PIPELINE:
        raise ValueError(f"moepass: unknown pass {name!r}; passes are {list(PIPELINE)}")
    return importlib.import_module(f"moepass.passes.{canonical_pass(name)}")


def graph_code(gm: fx.GraphModule) -> str:
    """Readable code of the graph and of every HOP body in it (activation checkpoint bodies, ...)."""
    parts = [gm.code]
    for scope in graph_scopes(gm)[1:]:
        parts.append(f"\n# ---- {scope.kind} body {scope.name}\n{scope.gm.code}")
    return "".join(parts)


def run_pipeline(gm: fx.GraphModule, example_inputs, config: Config) -> GraphRecord:
    """Rewrite `gm` (and the HOP bodies in it) in place with every enabled pass; return what happened."""
    with module_paths.indexing():  # full module paths, also for graphs of a frame resumed after a break
        record = _run_passes(gm, example_inputs, config)
    torch_logs.trace_graph_report(record)  # TORCH_TRACE + tlparse: the pass report beside Dynamo's graphs
    return record


def _run_passes(gm: fx.GraphModule, example_inputs, config: Config) -> GraphRecord:
    code_before = graph_code(gm)
    ops_before = op_histogram(gm)
    records, code_after = [], {}
    code = code_before
    for name in config.pipeline:
        mod = load_pass(name)
        torch_logs.trace_pass_graph(name, "before", lambda code=code: code)
        record = PassRecord(name)
        start = time.perf_counter()
        mod.run(gm, example_inputs, config, record)
        for scope in reversed(graph_scopes(gm)):  # bodies first: a parent's code calls them
            scope.graph.lint()
            scope.gm.recompile()
        record.ms = (time.perf_counter() - start) * 1e3
        records.append(record)
        code_after[name] = code = graph_code(gm)
        torch_logs.trace_pass_graph(name, "after", lambda code=code: code)
        log.info("moepass pass %s: replaced %d, skipped %d (%.1f ms)",
                 name, len(record.rewrites), len(record.skipped), record.ms)
    sac_policy.show_policies_replaced_gemms(gm)  # a selective-AC policy written for BF16 asks about aten.mm
    gemms = coverage.census(gm, records)  # every GEMM left: rewritten, kept BF16 with a reason, or unaccounted
    coverage.check_accounted(gemms)  # raises only under MOEPASS_STRICT_GEMMS (the tests)
    return GraphRecord(0, code_before, code_after, ops_before, op_histogram(gm), records,
                       weights_sharded=weights_sharded(gm), gemms=gemms)
