"""Inductor's `joint_custom_pre_pass` for moepass graphs: what the partitioner keeps for the backward and what it
gathers again, set on the joint graph before the partitioner reads it.

- EP dispatch / combine outputs are kept, never recomputed (ep_recompute: the backward sends nothing twice).
- Gathered FP8 rows are gathered again from the token rows, not kept (regather_rows: top_k times fewer bytes kept).
- With `segment_sums.permutations: "gather"`, sums along a routing permutation become gather-sums
  (permutation_sums), before the partitioner splits the forward's sort from the backward's sum.
"""

from __future__ import annotations

import logging

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from .cache_key import source_hash
from . import permutation_sums
from .ep_recompute import mark_exchanges_saved
from .regather_rows import mark_fp8_row_gathers_recomputed

log = logging.getLogger(__name__)


class SavedForBackward(CustomGraphPass):
    def __init__(self, permutation_gathers: bool = False):
        self.permutation_gathers = permutation_gathers

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.permutation_gathers:
            try:
                done = permutation_sums.rewrite(graph)
            except Exception as e:  # never worth failing a compile over: the sums stay for the post-grad stage
                log.warning("moepass: permutation gather-sums left out of this graph (%s: %s)", type(e).__name__, e)
            else:
                if done:
                    log.info("sums along a routing permutation as gather-sums: %s", ", ".join(done))
        mark_exchanges_saved(graph)
        regathered = mark_fp8_row_gathers_recomputed(graph)
        if regathered:
            log.info("gathered again in the backward, not kept: %s", ", ".join(g.node.name for g in regathered))

    def uuid(self) -> str:
        return f"moepass-saved-for-backward-{source_hash()}-{'gather' if self.permutation_gathers else 'kernel'}"
