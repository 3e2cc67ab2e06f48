"""What moepass does to a graph, in one place: the passes on the Dynamo graph, then the stage inside Inductor.

1. PASSES (moepass/passes/, in this order) rewrite the Dynamo graph: run_pipeline runs the enabled ones and records
   what each did. A pass exposes `NAME` and `run(gm, config, record) -> None`;
   `options["passes"]` picks a subset, the order stays this one (moepass.options.PIPELINE names it; a test keeps
   the two equal).
2. After the passes, on the same graph: selective-AC policies are shown the new GEMM ops (inductor_stage/sac_policy),
   and every GEMM left is counted: rewritten, kept BF16 with its reason, or unaccounted (report/coverage).
3. INDUCTOR_STAGE: what runs inside Inductor, set as its config entries by the backend (backend.py) or the Inductor
   route (inductor_route.py), besides the recipes' decompositions added to Inductor's table
   (recipes.registry.decompositions).
"""

from __future__ import annotations

import logging
import time

from torch import fx

from .report import coverage, torch_logs
from .analysis import module_paths
from .inductor_stage import sac_policy
from .analysis.fsdp import weights_sharded
from .analysis.scopes import graph_scopes
from .analysis.graph import op_histogram
from .inductor_stage.cache_key import CompiledGraphAudit
from .inductor_stage.saved_for_backward import SavedForBackward
from .options import PIPELINE, Config, canonical_pass
from .passes import deepep, grouped_mm, linear, quantize_once, weights_before_gemm
from .report.records import GraphRecord, PassRecord

log = logging.getLogger(__name__)

PASSES = {p.NAME: p for p in (deepep, weights_before_gemm, grouped_mm, quantize_once, linear)}
"""The passes, by name, in the order they run."""

INDUCTOR_STAGE = (
    # on the joint graph, before the partitioner reads it: EP exchanges kept for the backward (ep_recompute),
    # gathered FP8 rows gathered again rather than kept (regather_rows)
    ("joint_custom_pre_pass", SavedForBackward),
    # on each graph Inductor compiles (forward, backward): what it left of moepass's ops; its uuid is the cache key
    ("post_grad_custom_post_pass", CompiledGraphAudit),
)
"""Inductor config entry -> the moepass pass it holds, in the order Inductor runs them (the Inductor route's
RouteAudit hands each compiled graph to a CompiledGraphAudit)."""


def inductor_stage(audit) -> dict:
    """INDUCTOR_STAGE's config entries for one compile: a fresh joint-graph pass, `audit` in the post-grad slot."""
    return {"joint_custom_pre_pass": SavedForBackward(), "post_grad_custom_post_pass": audit}


def load_pass(name: str):
    """The pass module for a pass name (or an old name of one)."""
    if canonical_pass(name) not in PIPELINE:
        raise ValueError(f"moepass: unknown pass {name!r}; passes are {list(PIPELINE)}")
    return PASSES[canonical_pass(name)]


def graph_code(gm: fx.GraphModule) -> str:
    """Readable code of the graph and of every HOP body in it (activation checkpoint bodies, ...)."""
    parts = [gm.code]
    for scope in graph_scopes(gm)[1:]:
        parts.append(f"\n# ---- {scope.kind} body {scope.name}\n{scope.gm.code}")
    return "".join(parts)


def run_pipeline(gm: fx.GraphModule, config: Config) -> GraphRecord:
    """Rewrite `gm` (and the HOP bodies in it) in place with every enabled pass; return what happened."""
    with module_paths.indexing():  # full module paths, also for graphs of a frame resumed after a break
        record = _run_passes(gm, config)
    torch_logs.trace_graph_report(record)  # TORCH_TRACE + tlparse: the pass report beside Dynamo's graphs
    return record


def _run_passes(gm: fx.GraphModule, config: Config) -> GraphRecord:
    code_before = graph_code(gm)
    ops_before = op_histogram(gm)
    records, code_after = [], {}
    code = code_before
    for name in config.pipeline:
        mod = load_pass(name)
        torch_logs.trace_pass_graph(name, "before", lambda code=code: code)
        record = PassRecord(name)
        start = time.perf_counter()
        mod.run(gm, config, record)
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
