"""Blockwise FP8 grouped GEMMs (moepass::blockwise_grouped_mm, _dgrad, _wgrad, which recipe.py registers through the
op families lowp/grouped_mm.py and grouped_mm_rows.py).

x [M, K] @ w_t[g] [K, N] per token group g (offs: int32 group ends):
forward  x in 1x128 tiles along K (per row: no group crosses a tile), each expert's weight in 128x128 blocks
dgrad    grad_out in 1x128 tiles along N, each expert's weight in the same blocks, read transposed
wgrad    grad_out and x in 1x128 tiles along tokens, each group zero-padded to a multiple of 128 rows first
         (token_group_padding with block 128), so no tile straddles two groups
Kernels: "deepgemm" (kernels/deepgemm.py: DeepGEMM's grouped kernels through torchao); "scaled_mm", "triton" and
"emulated": the quantization here in plain torch (no host sync), then kernels/gemm.py's grouped_mm_nt: for
"scaled_mm" the opaque moepass::blockwise_scaled_grouped_mm, one GEMM per token group (group bounds read on the host:
one sync per op), for "triton" the opaque moepass::blockwise_triton_grouped_mm (one launch, no sync); the moepass
backend decomposes these ops into this code (decomp.py) so that Inductor fuses the quantization. Rows at or after
offs[-1] belong to no group: their outputs and input gradients are zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..grouped_mm_rows import RowGemms
from ..op_recipe import RecipeGemms
from ..token_group_padding import pad_token_groups, plan_token_group_padding
from . import quant
from .kernels import deepgemm
from .kernels.choice import check_settings
from .kernels.gemm import grouped_mm_nt


def forward(x: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """out = x[g] @ w_t[g] per token group."""
    if kernel == "deepgemm":
        return deepgemm.forward(x, w_t, offs)
    return forward_rows(*quant.quantize_tiles(x), w_t, offs, kernel)


def forward_rows(x_q: Tensor, x_scale: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """The forward on x already quantized in 1x128 tiles (quant.quantize_tiles): moepass::blockwise_grouped_mm_rows."""
    return grouped_mm_nt(*forward_operands(x_q, x_scale, w_t, offs), kernel)


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """grad_x = grad_out[g] @ w_t[g].T per token group."""
    if kernel == "deepgemm":
        return deepgemm.dgrad(grad_out, w_t, offs)
    return grouped_mm_nt(*dgrad_operands(grad_out, w_t, offs), kernel)


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g] -> [E, K, N] stored as [E, N, K] (the layout of w_t = w.transpose)."""
    if kernel == "deepgemm":
        return deepgemm.wgrad(grad_out, x, offs)
    return grouped_mm_nt(*wgrad_operands(grad_out, x, offs), kernel).transpose(-2, -1)  # [E, N, K] -> w_t's layout


# ---- the quantized operands of gemm.grouped_mm_nt per GEMM (examples/bench_fp8_gemms.py times the GEMMs on them) --

def forward_operands(x_q: Tensor, x_scale: Tensor, w_t: Tensor, offs: Tensor) -> tuple:
    w_q, w_scale = quant.quantize_blocks(w_t.transpose(-2, -1))  # [E, N, K]: B of A @ B.T per expert
    return x_q, x_scale, w_q, w_scale, offs


def dgrad_operands(grad_out: Tensor, w_t: Tensor, offs: Tensor) -> tuple:
    w_q, w_scale = quant.quantize_blocks(w_t)  # [E, K, N]: the forward's blocks, transposed
    return (*quant.quantize_tiles(grad_out), w_q, w_scale, offs)


def wgrad_operands(grad_out: Tensor, x: Tensor, offs: Tensor) -> tuple:
    plan = plan_token_group_padding(offs, x.shape[0], quant.TILE)  # every group a whole number of tiles, no sync
    g_q, g_scale = quant.quantize_tiles(pad_token_groups(grad_out, plan).t())  # [N, P], tiles along tokens
    x_q, x_scale = quant.quantize_tiles(pad_token_groups(x, plan).t())  # [K, P]
    return g_q, g_scale, x_q, x_scale, plan.padded_offs


def _dequantize_rows(q: Tensor, scale: Tensor) -> Tensor:
    return quant.dequantize_tiles(q, scale).to(torch.bfloat16)


# registered as ops by recipe.py
GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)
# rows quantized before their gather: 1x128 tiles along K (DeepGEMM quantizes its operands itself: no rows form)
ROWS = RowGemms(lambda x, kernel: quant.quantize_tiles(x), forward_rows, _dequantize_rows, lambda k: k // quant.TILE,
                kernels=("scaled_mm", "triton", "emulated"), fp8_wgrad_on_rows=False)
