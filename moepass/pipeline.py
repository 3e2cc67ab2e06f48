"""What moepass does to a graph, in one place: the passes on the Dynamo graph, then the stage inside Inductor.

1. PASSES (moepass/passes/<name>.py, in the order moepass.options.PIPELINE names them) rewrite the Dynamo graph:
   run_pipeline runs the enabled ones and records what each did. A pass exposes `NAME` and
   `run(gm, config, record) -> None`; `options["passes"]` picks a subset, the order stays this one.
2. After the passes, on the same graph: selective-AC policies are shown the new GEMM ops (inductor_stage/sac_policy),
   and every GEMM left is counted: rewritten, kept BF16 with its reason, or unaccounted (report/coverage).
3. INDUCTOR_STAGE: what runs inside Inductor, set as its config entries by the backend (backend.py) or the Inductor
   route (inductor_route.py), besides the recipes' decompositions added to Inductor's table
   (recipes.registry.decompositions).

Both entry points do the same with a Dynamo graph, here: rewrite_and_report (the passes, then the graph's record into
its report), and inductor_handoff (what Inductor gets: the recipes' decompositions, INDUCTOR_STAGE's entries, the
audit that keeps the report and the cache key).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .report import collect, coverage, torch_logs
from .analysis import module_paths
from .inductor_stage import sac_policy
from .analysis.fsdp import weights_sharded
from .analysis.scopes import graph_scopes
from .analysis.graph import op_histogram
from .inductor_stage.cache_key import CompiledGraphAudit
from .inductor_stage.saved_for_backward import SavedForBackward
from .inductor_stage.post_grad import PostGrad
from .options import PIPELINE, Config, canonical_pass
from . import passes
from .recipes import registry
from .report.records import GraphRecord, PassRecord

log = logging.getLogger(__name__)

PASSES = {name: importlib.import_module(f"{passes.__name__}.{name}") for name in PIPELINE}
"""The passes, by name, in the order they run: the module moepass.passes.<name> for each name of options.PIPELINE
(the order is written there only, where the `passes` option reads it)."""

INDUCTOR_STAGE = (
    # on the joint graph, before the partitioner reads it: EP exchanges kept for the backward (ep_recompute),
    # gathered FP8 rows gathered again rather than kept (regather_rows)
    ("joint_custom_pre_pass", SavedForBackward),
    # on each graph Inductor compiles (forward, backward): scatter-adds of rows as segment sums (segment_sums), then
    # the audit of what it left of moepass's ops; its uuid is the cache key
    ("post_grad_custom_post_pass", PostGrad),
)
"""Inductor config entry -> the moepass pass it holds, in the order Inductor runs them (the Inductor route's
RouteAudit hands each compiled graph to a CompiledGraphAudit)."""


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


class RewrittenGraph(NamedTuple):
    """A Dynamo graph after the passes, as an entry point holds it until Inductor has compiled it."""
    record: GraphRecord
    save: Callable[[], None]  # writes the report holding `record` to its report_dirs again; never raises


def rewrite_and_report(gm: fx.GraphModule, config: Config, compile_call=None) -> RewrittenGraph:
    """run_pipeline on `gm`, its record added to the report it belongs to (collect.current_report: `compile_call`
    groups graphs by torch.compile call, None when unknown), the summary logged and the report saved."""
    import moepass.ops  # noqa: F401  (registers the custom ops the passes target)

    record = run_pipeline(gm, config)
    report = collect.current_report(config, compile_call)
    held = report.add_graph(record)
    if log.isEnabledFor(logging.INFO):  # the summary covers every graph of the report: not built unless shown
        log.info("%s", report.summary())
    rewritten = RewrittenGraph(record, lambda: collect.save_graph(report, held))
    rewritten.save()  # to every report_dir of the report; never raises
    return rewritten


@dataclasses.dataclass(frozen=True)
class InductorHandoff:
    """What Inductor gets from moepass under one Config, its recipes' "auto" options settled (registry.settle)."""
    decompositions: dict  # the recipes' decompositions, added to Inductor's table (they are in no cache key...)
    variant: str  # ...so the options they read go into the audit's uuid (registry.cache_variant)
    segment_sums: tuple[str, ...] | None  # the device types whose scatter-adds of rows become segment sums; None: any
    permutation_gathers: bool  # sums along a routing permutation as gather-sums, in the joint graph

    def audit(self, rewritten: RewrittenGraph) -> CompiledGraphAudit:
        """The audit of one rewritten graph: each graph Inductor compiles from it (the forward now, the backward at
        the first backward) is recorded into its record, and the report saved again."""
        return CompiledGraphAudit(rewritten.record.compiled, self.variant, on_compiled=rewritten.save)

    def inductor_config(self, audit: CustomGraphPass) -> dict:
        """INDUCTOR_STAGE's config entries for one compile: a fresh joint-graph pass, the segment sums then `audit` in
        the post-grad slot."""
        return {"joint_custom_pre_pass": SavedForBackward(self.permutation_gathers),
                "post_grad_custom_post_pass": PostGrad(self.segment_sums, audit)}


def inductor_handoff(config: Config, weights_sharded: bool) -> InductorHandoff:
    """The handoff to Inductor of graphs whose GEMMs' weights are (or are not) sharded by FSDP2."""
    settled = registry.settle(config, weights_sharded)
    sums = config.section("segment_sums")
    devices = {"cuda": ("cuda",), "all": None, "none": ()}[sums.devices]
    return InductorHandoff(registry.decompositions(settled), registry.cache_variant(settled), devices,
                           sums.permutations == "gather")
