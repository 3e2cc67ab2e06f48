"""Blockwise FP8 linear GEMMs (moepass::blockwise_linear, _dgrad, _wgrad, which recipe.py registers through the op
family lowp/linear.py).

forward  y = x @ W.T (+ b):       x in 1x128 tiles along K, W in 128x128 blocks
dgrad    grad_x = grad_out @ W:   grad_out in 1x128 tiles along N, W in the same 128x128 blocks, read transposed
wgrad    grad_W = grad_out.T @ x: both in 1x128 tiles along tokens (128x1 down the token dim), tokens zero-padded
                                  to a multiple of 128 (zero rows add nothing)
Each is the quantization here in plain torch, then kernels/gemm.py's mm_nt (A @ B.T, both K-major) on kernel "scaled_mm"
(torch._scaled_mm, sm_90, inside the opaque moepass::blockwise_scaled_mm) or "emulated". The moepass backend decomposes
the "scaled_mm" ops into this same code (decomp.py), so Inductor fuses the quantization and only the GEMM stays opaque.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..op_recipe import RecipeGemms
from . import quant
from .kernels.choice import check_settings
from .kernels.gemm import mm_nt


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: str) -> Tensor:
    x_q, x_scale = quant.quantize_tiles(x.reshape(-1, x.shape[-1]))
    w_q, w_scale = quant.quantize_blocks(weight)  # [N, K]: B of A @ B.T as it is
    y = mm_nt(x_q, x_scale, w_q, w_scale, True, kernel)
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as the other recipes' linears do
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dgrad(grad_out: Tensor, weight: Tensor, kernel: str) -> Tensor:
    g_q, g_scale = quant.quantize_tiles(grad_out.reshape(-1, grad_out.shape[-1]))
    w_t_q, w_t_scale = quant.quantize_blocks(weight.t())  # [K, N]: the forward's blocks, transposed
    grad_x = mm_nt(g_q, g_scale, w_t_q, w_t_scale, True, kernel)
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def _tokens_last(t: Tensor) -> Tensor:
    """[..., D] -> [D, round_up(tokens, 128)]: tokens as the reduction dim, zero-padded to whole tiles."""
    t2 = t.reshape(-1, t.shape[-1])
    return F.pad(t2, (0, 0, 0, -t2.shape[0] % quant.TILE)).t()


def wgrad(grad_out: Tensor, x: Tensor, kernel: str) -> Tensor:
    g_q, g_scale = quant.quantize_tiles(_tokens_last(grad_out))  # [N, T], tiles along tokens
    x_q, x_scale = quant.quantize_tiles(_tokens_last(x))  # [K, T]
    return mm_nt(g_q, g_scale, x_q, x_scale, False, kernel)  # [N, K]; no tokens: zeros


GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)  # registered as ops by recipe.py
