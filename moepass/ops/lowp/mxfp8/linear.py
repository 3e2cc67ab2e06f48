"""MXFP8 linear GEMMs (moepass::mxfp8_linear, _dgrad, _wgrad, which recipe.py registers through the op family
lowp/linear.py).

They mirror torchao's mx_mm: y = x @ W.T + b with x and W quantized to MXFP8 along K; dgrad scales grad_out and W
along N; wgrad scales grad_out and x along tokens (padded with zero rows to a multiple of 32).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..op_recipe import RecipeGemms
from .kernels.choice import check_settings
from .quant import BLOCK, dequantized_rows, kernel_weight, to_mx_along_cols, to_mx_along_rows


def _emulated_mm_nt(a: Tensor, b: Tensor, scale_rounding: str) -> Tensor:
    """a [M, K] @ b [N, K].T with both quantized along K: torchao's emulated MX mm (a row-major, b column-major)."""
    return torch.mm(dequantized_rows(a, scale_rounding), dequantized_rows(b, scale_rounding).t())


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale_rounding: str, kernel: str) -> Tensor:
    """y = x @ W.T (+ b): x and W scaled along K."""
    x2 = x.reshape(-1, x.shape[-1])
    if kernel == "emulated":
        y = _emulated_mm_nt(x2, weight, scale_rounding)
    else:
        y = torch.mm(to_mx_along_rows(x2, scale_rounding, kernel),
                     to_mx_along_rows(kernel_weight(weight), scale_rounding, kernel).t())
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as torchao's MXFP8Linear does (its quantize_ path drops bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dgrad(grad_out: Tensor, weight: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_x = grad_out @ W, both scaled along N."""
    go = grad_out.reshape(-1, grad_out.shape[-1])
    if kernel == "emulated":
        grad_x = _emulated_mm_nt(go, weight.t(), scale_rounding)
    else:
        grad_x = torch.mm(to_mx_along_rows(go, scale_rounding, kernel),
                          to_mx_along_cols(kernel_weight(weight), scale_rounding, kernel).t())
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def _pad_tokens(t: Tensor) -> Tensor:
    """[M, D] -> [round_up(M, 32), D] with zero rows: zeros add nothing to grad_out.T @ x."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % BLOCK))


def wgrad(grad_out: Tensor, x: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_W = grad_out.T @ x, both scaled along tokens."""
    go = _pad_tokens(grad_out.reshape(-1, grad_out.shape[-1]))
    xr = _pad_tokens(x.reshape(-1, x.shape[-1]))
    if kernel == "emulated":
        return _emulated_mm_nt(go.t(), xr.t(), scale_rounding)
    go_t_mx = to_mx_along_cols(go, scale_rounding, kernel)  # [N, M]
    x_mx = to_mx_along_cols(xr, scale_rounding, kernel).t()  # [M, K]
    return torch.mm(go_t_mx, x_mx)


GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)  # registered as ops by recipe.py
