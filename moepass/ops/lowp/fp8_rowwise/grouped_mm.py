"""FP8-rowwise grouped GEMMs (moepass::fp8_rowwise_grouped_mm, _dgrad, _wgrad, which recipe.py registers through the
op families lowp/grouped_mm.py and grouped_mm_rows.py).

Forward: x per row, each expert's weight per output channel (along K); dgrad: grad_out per row, each
expert's weight per input channel (along N); wgrad: grad_out and x per (token group, column). GEMMs:
torch._scaled_grouped_mm on sm_90 (kernel "scaled_mm"), or exact dequantization and torch._grouped_mm
in BF16 (kernel "emulated", the same numerics). Token groups need no alignment: the 2d-3d GEMMs take any
group sizes, and the wgrad's operands are quantized straight into 16-aligned groups (kernels/token_group_cols.py).
Rows at or after offs[-1] belong to no group: their outputs and input gradients are zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import E4M3
from ..grouped_mm_rows import RowGemms
from ..grouped_wgrad_bf16 import as_transposed_layout
from ..op_recipe import RecipeGemms
from ..swiglu_rows import SwiGLURows
from . import quant
from .kernels import swiglu
from .decomp import grouped_mm_wgrad, grouped_mm_wgrad_on_rows
from .kernels.choice import check_settings
from .kernels.scaled_gemms import scaled_grouped_mm, zero_rows_after_last_group


def _zero_rows_after_last_group(out: Tensor, offs: Tensor, kernel: str) -> Tensor:
    if kernel == "emulated":
        return zero_rows_after_last_group(out, offs)
    from .kernels.triton_zero_rows import zero_rows_from_group_end_

    return zero_rows_from_group_end_(out, offs)


def forward(x: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    if x.shape[0] == 0:
        return x.new_zeros(0, w_t.shape[2])
    return forward_rows(*quant.rows(x, kernel), w_t, offs, kernel)  # x: [M, K], [M, 1]


def forward_rows(x_q: Tensor, x_scale: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """The forward on x already quantized per row (quant.rows): moepass::fp8_rowwise_grouped_mm_rows."""
    if x_q.shape[0] == 0:
        return x_q.new_zeros(0, w_t.shape[2], dtype=torch.bfloat16)
    w_q, w_scale = quant.experts_along_k(w_t, kernel)  # [E, K, N] column-major, [E, 1, N]
    if kernel == "emulated":
        out = torch._grouped_mm(quant.dequantize(x_q, x_scale), quant.dequantize(w_q, w_scale), offs=offs)
    else:
        out = scaled_grouped_mm(x_q, x_scale.reshape(-1), w_q, w_scale.squeeze(1), offs)
    return _zero_rows_after_last_group(out, offs, kernel)


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """grad_x = grad_out @ w_t[g].T per group, scaled along N."""
    if grad_out.shape[0] == 0:
        return grad_out.new_zeros(0, w_t.shape[1])
    g_q, g_scale = quant.rows(grad_out, kernel)  # [M, N], [M, 1]
    w_q, w_scale = quant.experts_along_n(w_t, kernel)  # [E, K, N] row-major, [E, K, 1]
    if kernel == "emulated":
        w = quant.dequantize(w_q, w_scale).transpose(-2, -1)
        grad_x = torch._grouped_mm(quant.dequantize(g_q, g_scale), w, offs=offs)
    else:
        grad_x = scaled_grouped_mm(g_q, g_scale.reshape(-1), w_q.transpose(-2, -1), w_scale.squeeze(-1), offs)
    return _zero_rows_after_last_group(grad_x, offs, kernel)


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g], scaled along each group's tokens."""
    if x.shape[0] == 0:
        return as_transposed_layout(x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1]))
    if kernel == "emulated":
        g_q, g_scale = quant.token_group_cols(grad_out, offs)  # [M, N], [E, N]
        x_q, x_scale = quant.token_group_cols(x, offs)  # [M, K], [E, K]
        g = quant.dequantize_token_groups(g_q, g_scale, offs)
        grad_w = torch._grouped_mm(g.t(), quant.dequantize_token_groups(x_q, x_scale, offs), offs=offs)
        return grad_w.transpose(-2, -1)  # [E, N, K] -> [E, K, N], column-major like w_t
    return grouped_mm_wgrad(grad_out, x, offs)


def wgrad_on_rows(grad_out: Tensor, x_q: Tensor, x_scale: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """wgrad(grad_out, quant.dequantize(x_q, x_scale), offs) bit for bit; the scaled_mm kernel reads x_q itself."""
    if kernel == "emulated" or x_q.shape[0] == 0:
        return wgrad(grad_out, quant.dequantize(x_q, x_scale), offs, kernel)
    return grouped_mm_wgrad_on_rows(grad_out, x_q, x_scale, offs)


def _rows_quantize(x: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    return quant.rows(x, kernel) if x.shape[0] else (x.to(E4M3), x.new_ones(0, 1, dtype=torch.float32))


# registered as ops by recipe.py
GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)
# rows quantized before their gather: one power-of-two scale per row, so dequantization is exact
SWIGLU = SwiGLURows(swiglu.forward, swiglu.backward, lambda k: 1, lambda k: k // swiglu.tile_width(k))
ROWS = RowGemms(_rows_quantize, forward_rows, quant.dequantize, lambda k: 1, kernels=("scaled_mm", "emulated"),
                fp8_wgrad_on_rows=True, wgrad=wgrad_on_rows, swiglu=SWIGLU)
