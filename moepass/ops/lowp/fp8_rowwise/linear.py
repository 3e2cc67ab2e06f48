"""FP8-rowwise linear GEMMs (moepass::fp8_rowwise_linear, _dgrad, _wgrad, which recipe.py registers through the op
family lowp/linear.py): the Hopper-native FP8 recipe.

y = x @ W.T (+ b) with x scaled per row and W per output channel (both along K); dgrad scales grad_out
per row and W per input channel (both along N); wgrad scales grad_out and x per column (along tokens).
Every scale is a power of two (quant); the GEMMs are torch._scaled_mm on sm_89+
(kernel "scaled_mm") or exact dequantization and a BF16 GEMM (kernel "emulated", same numerics).
Kernel "scaled_mm" runs decomp's plain-torch quantization: eagerly here, and fused by Inductor
when the moepass backend decomposes these ops (so eager and compiled share one definition, no autotuning).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..op_recipe import RecipeGemms
from . import decomp, quant
from .kernels.choice import check_settings


def _emulated_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor) -> Tensor:
    """a [M, K] (scale [M, 1]) @ b [K, N] (scale [1, N]) -> bf16 [M, N], dequantized exactly."""
    return torch.mm(quant.dequantize(a_q, a_scale), quant.dequantize(b_q, b_scale))


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: str) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    if tokens and kernel == "scaled_mm":
        return decomp.linear(x, weight, bias)
    if tokens == 0:
        y = x2.new_zeros(0, weight.shape[0])
    else:
        x_q, x_scale = quant.quantize(x2, -1)
        w_q, w_scale = quant.quantize(weight, -1)
        y = _emulated_mm(x_q, x_scale, w_q.t(), w_scale.reshape(1, -1))
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as the MXFP8 linear does
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dgrad(grad_out: Tensor, weight: Tensor, kernel: str) -> Tensor:
    """grad_x = grad_out @ W, both scaled along N."""
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    tokens = g2.shape[0]
    if tokens == 0:
        return grad_out.new_zeros(*grad_out.shape[:-1], weight.shape[1])
    if kernel == "scaled_mm":
        return decomp.linear_dgrad(grad_out, weight)
    g_q, g_scale = quant.quantize(g2, -1)
    w_q, w_scale = quant.quantize(weight, 0)
    grad_x = _emulated_mm(g_q, g_scale, w_q, w_scale)
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def wgrad(grad_out: Tensor, x: Tensor, kernel: str) -> Tensor:
    """grad_W = grad_out.T @ x, both scaled along tokens."""
    g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    if g2.shape[0] == 0:
        return x.new_zeros(g2.shape[1], x2.shape[1])  # no tokens: no column has an amax
    if kernel == "scaled_mm":
        return decomp.linear_wgrad(grad_out, x)
    g_q, g_scale = quant.quantize(g2, 0)  # scaled per column, along tokens
    x_q, x_scale = quant.quantize(x2, 0)
    return _emulated_mm(g_q.t(), g_scale.reshape(-1, 1), x_q, x_scale)


GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)  # registered as ops by recipe.py
