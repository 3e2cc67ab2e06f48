"""Blockwise FP8 grouped GEMMs (moepass::blockwise_grouped_mm, _dgrad, _wgrad; the op family is lowp/grouped_mm.py).

x [M, K] @ w_t[g] [K, N] per token group g (offs: int32 group ends):
forward  x in 1x128 tiles along K (per row: no group crosses a tile), each expert's weight in 128x128 blocks
dgrad    grad_out in 1x128 tiles along N, each expert's weight in the same blocks, read transposed
wgrad    grad_out and x in 1x128 tiles along tokens, each group zero-padded to a multiple of 128 rows first
         (mxfp8_token_groups with block 128), so no tile straddles two groups
Kernels: "deepgemm" (deepgemm.py: DeepGEMM's grouped kernels through torchao); "scaled_mm" and "emulated": one
gemm.mm_nt per token group (group bounds read on the host: one sync per op). Rows at or after offs[-1] belong to no
group: their outputs and input gradients are zero.
"""

from __future__ import annotations

from torch import Tensor

from moepass.recipes.blockwise import BLOCKWISE

from ..grouped_mm import define_grouped_mm_ops
from ..mxfp8_token_groups import pad_token_groups, plan_token_group_padding
from ..op_recipe import RecipeGemms
from . import deepgemm, quant
from .gemm import mm_nt
from .kernels import check_settings


def _groups(ends: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every non-empty group, from int group ends (a host sync)."""
    bounds = ends.tolist()
    return [(g, start, end) for g, (start, end) in enumerate(zip([0, *bounds[:-1]], bounds)) if end > start]


def forward(x: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """out = x[g] @ w_t[g] per token group."""
    if kernel == "deepgemm":
        return deepgemm.forward(x, w_t, offs)
    x_q, x_scale = quant.quantize_tiles(x)
    w_q, w_scale = quant.quantize_blocks(w_t.transpose(-2, -1))  # [E, N, K]: B of A @ B.T per expert
    out = x.new_zeros(x.shape[0], w_t.shape[2])
    for g, start, end in _groups(offs):
        out[start:end] = mm_nt(x_q[start:end], x_scale[start:end], w_q[g], w_scale[g], True, kernel)
    return out


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """grad_x = grad_out[g] @ w_t[g].T per token group."""
    if kernel == "deepgemm":
        return deepgemm.dgrad(grad_out, w_t, offs)
    g_q, g_scale = quant.quantize_tiles(grad_out)
    w_q, w_scale = quant.quantize_blocks(w_t)  # [E, K, N]: the forward's blocks, transposed
    grad_x = grad_out.new_zeros(grad_out.shape[0], w_t.shape[1])
    for g, start, end in _groups(offs):
        grad_x[start:end] = mm_nt(g_q[start:end], g_scale[start:end], w_q[g], w_scale[g], True, kernel)
    return grad_x


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g] -> [E, K, N] stored as [E, N, K] (the layout of w_t = w.transpose)."""
    if kernel == "deepgemm":
        return deepgemm.wgrad(grad_out, x, offs)
    plan = plan_token_group_padding(offs, x.shape[0], quant.TILE)  # every group a whole number of tiles
    g_q, g_scale = quant.quantize_tiles(pad_token_groups(grad_out, plan).t())  # [N, P], tiles along tokens
    x_q, x_scale = quant.quantize_tiles(pad_token_groups(x, plan).t())  # [K, P]
    grad_w = x.new_zeros(offs.shape[0], grad_out.shape[1], x.shape[1])  # [E, N, K]
    for g, start, end in _groups(plan.padded_offs):
        tiles = slice(start // quant.TILE, end // quant.TILE)
        grad_w[g] = mm_nt(g_q[:, start:end], g_scale[:, tiles], x_q[:, start:end], x_scale[:, tiles], False, kernel)
    return grad_w.transpose(-2, -1)


define_grouped_mm_ops(BLOCKWISE, RecipeGemms(forward, dgrad, wgrad, check_settings))
