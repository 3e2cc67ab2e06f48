"""Gathered FP8 rows are gathered again in the backward, not kept: the backward keeps the token rows.

quantize_once gathers FP8 token rows (and their scales) into expert order for the expert GEMMs, top_k rows per token.
The backward's FP8 wgrad reads those rows through a moepass op (the token-group quantization), and PyTorch's
partitioner never recomputes a node whose backward consumer it cannot fuse ("materialized in backward"): it keeps
the gathered rows from the forward until the backward, top_k times the token rows' bytes (at DeepSeek-V3 dims 0.94 GB
a layer against 0.12 GB). Gathering them again costs the backward one write and one read of the FP8 rows; the BF16
rows the wgrad read before were as large twice over. This joint-graph pass marks such gathers PREFER_RECOMPUTE, so the
partitioner keeps their sources (the token rows and the index) and gathers again. A gather that another policy
already tagged (activation checkpointing's) keeps its tag.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils.checkpoint import CheckpointPolicy

from ..analysis.row_gathers import gathered_from
from ..analysis.graph import tensor_meta

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


@dataclasses.dataclass(frozen=True)
class RowGather:
    node: torch.fx.Node  # the gather (analysis.row_gathers.gathered_from: aten.index(src, [index]), index_select)
    source: torch.fx.Node
    index: torch.fx.Node


def _row_gather(node: torch.fx.Node) -> RowGather | None:
    found = gathered_from(node)
    return None if found is None else RowGather(node, *found)


def _forward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's nodes the forward outputs need. The outputs are the forward's, then the gradients; a
    gradient depends on an incoming gradient (AOTAutograd names them tangents_*), a forward output never does. What
    the forward does not need runs in the backward, also where it reads only forward values (the wgrad's quantization
    of x)."""
    from_tangents = {n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")}
    for node in graph.nodes:  # topological order: a node's inputs come first
        if node not in from_tangents and any(arg in from_tangents for arg in node.all_input_nodes):
            from_tangents.add(node)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    needed = [n for n in output.all_input_nodes if n not in from_tangents]
    forward = set()
    while needed:
        node = needed.pop()
        if node not in forward:
            forward.add(node)
            needed.extend(node.all_input_nodes)
    return forward


def _expands(gather: RowGather) -> bool:
    """The gather has at least as many rows as its source (keeping the source is no larger), known at compile time."""
    out, src = tensor_meta(gather.node), tensor_meta(gather.source)  # gathered_from checked the source's
    return out is not None and statically_known_true(out.shape[0] >= src.shape[0])


def find_fp8_row_gathers(graph: torch.fx.Graph) -> list[RowGather]:
    """Gathers of FP8 rows (and of their scales, by the same index) that the backward reads and that expand their
    source, not already tagged by a recompute policy."""
    forward = _forward_nodes(graph)
    gathers = [g for g in map(_row_gather, graph.nodes) if g is not None and g.node in forward]
    fp8_indices = {g.index for g in gathers if getattr(tensor_meta(g.node), "dtype", None) in FLOAT8}
    return [g for g in gathers if g.index in fp8_indices and "recompute" not in g.node.meta
            and any(user not in forward for user in g.node.users) and _expands(g)]


def mark_fp8_row_gathers_recomputed(graph: torch.fx.Graph) -> list[RowGather]:
    """Tag what find_fp8_row_gathers finds PREFER_RECOMPUTE; returns it."""
    found = find_fp8_row_gathers(graph)
    for gather in found:
        gather.node.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return found
