"""The post-grad graph audit that also keeps the compile caches honest about moepass's code.

Inductor calls it on every post-grad graph it compiles (forward and backward), so the report
can show which moepass ops (and collectives) really reached the compiled graphs: the quantized dgrad and
wgrad GEMMs only exist in the backward graph AOTAutograd derives. Ops a recipe decomposes for Inductor are gone by
this point: they show as the aten GEMMs the recipe names (FP8-rowwise "scaled_mm": aten._scaled_mm /
_scaled_grouped_mm). It never changes a graph.

A custom op's Python body and autograd formula are not part of Inductor's FX-graph cache key
or the AOTAutograd cache key, so after editing an op (or its decomposition) a warm cache could
serve the old code.
Inductor does hash the `uuid()` of custom graph passes in its config: ours is a hash of the moepass
source files that can shape a compiled graph (the engine, its analysis, ops and passes) and of the data files
shipped beside them (the FP8 tables recipe="auto" reads); the benchmark harness is left out, so editing a chart
does not invalidate compiled graphs. (On a cache hit the graph is not recompiled, so nothing is audited.)
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import pathlib
from collections import Counter
from collections.abc import Callable

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..recipes import registry


log = logging.getLogger(__name__)

NOT_HASHED = ("harness",)  # folders under a root whose code never reaches a compiled graph
# the package data that shapes a rewrite, wherever it sits (pyproject.toml's package-data: the shipped FP8 tables)
DATA_FILES = ("*.json",)


def source_files(roots: list[pathlib.Path]) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(root, path) of every .py file and data file (DATA_FILES) under `roots` outside NOT_HASHED, in a fixed order."""
    return [(root, path) for root in sorted(roots) for pattern in ("*.py", *DATA_FILES)
            for path in sorted(root.rglob(pattern)) if path.relative_to(root).parts[0] not in NOT_HASHED]


def tree_hash(roots: list[pathlib.Path]) -> str:
    digest = hashlib.sha256()
    for root, path in source_files(roots):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def source_roots() -> list[pathlib.Path]:
    """The moepass package (engine, analysis, ops) and the passes, installed as moepass.passes: found by path, not
    imported (both sit above inductor_stage/)."""
    roots = {pathlib.Path(__file__).resolve().parents[1]}
    passes = importlib.util.find_spec("moepass.passes")
    if passes is not None and passes.origin:  # absent only where a source checkout shadows the install (python -m)
        roots.add(pathlib.Path(passes.origin).resolve().parent)
    return sorted(roots)


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    return tree_hash(source_roots())


def graph_kind(graph: torch.fx.Graph) -> str:
    """AOTAutograd names the incoming gradients of a backward graph `tangents_*`."""
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    return "backward" if any(n.startswith("tangents") for n in names) else "forward"


# aten GEMMs worth reporting: the BF16 ones, and those the recipes' decompositions leave (registry.decomposed_gemms)
BF16_GEMMS = ("mm", "addmm", "bmm", "_grouped_mm")
GEMMS = (*BF16_GEMMS, *sorted(registry.decomposed_gemms()))


class CompiledGraphAudit(CustomGraphPass):
    """Records the moepass ops (and plain GEMMs) of each compiled graph into `sink`, then calls `on_compiled`
    (the backend saves the report again: the backward graph compiles long after the backend returned)."""

    def __init__(self, sink: list | None = None, variant: str = "", on_compiled: Callable[[], None] | None = None):
        self.sink = sink if sink is not None else []
        self.variant = variant  # what else shapes the compiled code (registry.cache_variant: decompositions' options)
        self.on_compiled = on_compiled

    def __call__(self, graph: torch.fx.Graph) -> None:
        ops = Counter()
        for n in graph.nodes:
            t = n.target
            if n.op == "call_function" and isinstance(t, torch._ops.OpOverload):
                # collectives too: under activation checkpointing the backward must not send tokens again
                if t.namespace in ("moepass", "_c10d_functional") or t._opname in GEMMS:
                    ops[f"{t.namespace}.{t._opname}"] += 1
            if n.meta.get("moepass_rewrite"):  # aten nodes a moepass rewrite made (permutation_sums)
                ops[f"moepass.{n.meta['moepass_rewrite']}"] += 1
        self.sink.append({"kind": graph_kind(graph), "ops": dict(sorted(ops.items()))})
        if self.on_compiled is not None:
            try:
                self.on_compiled()
            except Exception as e:  # a report is never worth failing a compile over
                log.warning("moepass: reporting a compiled graph failed (%s: %s)", type(e).__name__, e)

    def uuid(self) -> str:
        return f"moepass-{source_hash()}" + (f"-{self.variant}" if self.variant else "")
