"""Custom op ``moepass::ep_expert_major_pairs``: received rows -> (row, local expert) pairs, expert-major.

After ``moepass::ep_dispatch`` a token arrives once per destination rank, with up to K local expert ids
(-1 where the expert lives elsewhere). The grouped expert GEMMs want one row per (token, expert) pair,
grouped by local expert. This op lists those pairs; the caller gathers ``recv_x[pair_row]`` and the
routing weight ``recv_topk_weights.reshape(-1)[pair_slot]``.

    ep_expert_major_pairs(recv_topk_idx[R,K] int64, num_local_experts) -> pair_row[P] int64, pair_slot[P] int64

Pairs are ordered by local expert, then by received row, then by k (a stable sort), so within one expert
rows keep DeepEP's receive order (source rank, then source token). P, the number of ids >= 0, is data
dependent: the fake kernel returns it as an unbacked SymInt, so one compiled graph serves every routing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..fresh_outputs import fresh_outputs


def _check_args(recv_topk_idx: Tensor, num_local_experts: int) -> None:
    if recv_topk_idx.dim() != 2 or recv_topk_idx.dtype != torch.int64:
        raise TypeError(f"recv_topk_idx must be int64 [R, K]; got {recv_topk_idx.dtype} {tuple(recv_topk_idx.shape)}")
    if num_local_experts <= 0:
        raise ValueError(f"num_local_experts must be positive; got {num_local_experts}")


@torch.library.custom_op("moepass::ep_expert_major_pairs", mutates_args=())
def ep_expert_major_pairs(recv_topk_idx: Tensor, num_local_experts: int) -> tuple[Tensor, Tensor]:
    _check_args(recv_topk_idx, num_local_experts)
    flat = recv_topk_idx.reshape(-1)
    routed_here = flat >= 0
    # -1 (expert on another rank) sorts after every local expert and is cut off below
    key = torch.where(routed_here, flat, num_local_experts)
    order = torch.argsort(key, stable=True)
    pair_slot = order[: int(routed_here.sum())].clone()
    return fresh_outputs((pair_slot // recv_topk_idx.shape[1], pair_slot), (recv_topk_idx,))


@ep_expert_major_pairs.register_fake
def _ep_expert_major_pairs_fake(recv_topk_idx, num_local_experts):
    _check_args(recv_topk_idx, num_local_experts)
    num_pairs = torch.library.get_ctx().new_dynamic_size()
    return recv_topk_idx.new_empty((num_pairs,)), recv_topk_idx.new_empty((num_pairs,))
