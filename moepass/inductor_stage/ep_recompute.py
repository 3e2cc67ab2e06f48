"""EP dispatch and combine are never recomputed: under activation checkpointing the backward sends nothing twice.

Full AC asks the partitioner to recompute everything in a checkpointed block; a selective policy
(torchtitan's op-level SAC) saves the ops it lists, and `all_to_all_single` is on torchtitan's list,
but `moepass::ep_dispatch` / `ep_combine` are on nobody's. Left alone, the backward would run the
dispatch (and combine) again: one more all-to-all of every routed token per layer. PyTorch's
partitioner already refuses to recompute `_c10d_functional` collectives outside AC regions; this
joint-graph pass extends that to moepass's EP ops inside them, marking their outputs MUST_SAVE. The
cost is memory: the received rows stay alive until the backward, as a saved all-to-all's would.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy

from ..op_registry import is_exchange


def is_ep_exchange(node: torch.fx.Node) -> bool:
    """moepass's EP dispatch / combine ops (forward and backward), as ops/ep registers them."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and is_exchange(node.target)


def _mark_saved(node: torch.fx.Node) -> None:
    node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    for user in node.users:  # a tuple output is saved through its getitems (the partitioner skips tuples)
        if user.op == "call_function" and user.target is operator.getitem:
            _mark_saved(user)


def mark_exchanges_saved(graph: torch.fx.Graph) -> None:
    """EP dispatch/combine outputs in a joint graph are saved for backward, never recomputed."""
    for node in graph.nodes:
        if is_ep_exchange(node):
            _mark_saved(node)
