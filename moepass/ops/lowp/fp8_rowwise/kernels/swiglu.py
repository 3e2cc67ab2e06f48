"""SwiGLU fused with the FP8-rowwise quantization of its output, keeping its inputs in FP8 for the backward.

An expert MLP's h = silu(gate) * up is w2's input: quantize_once already quantizes h's rows where h is made (one
scale per row). Its backward reads gate and up, which the forward then keeps in BF16 (2 x 2 bytes per element of
[M, inter], the largest activations an MoE layer keeps once its GEMM inputs are FP8). Here one pass over gate and up
writes h's FP8 rows and scales (w2's operand and what its wgrad keeps) and gate and up in e4m3 with one power-of-two
scale per 1x128 tile (DeepSeek-V3 keeps these in FP8 the same way; a row shorter than or not a multiple of 128 is one
tile). No BF16 h and no BF16 gate or up outlive the forward; the backward recomputes silu from the FP8 copies.

h is rounded to BF16 before its quantization, as the model's h is a BF16 tensor. On CUDA (kernel "scaled_mm") the
Triton kernel of triton_swiglu.py runs; elsewhere this torch reference, the same numerics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import quant

TILE = 128  # columns per scale of the saved gate and up (DeepSeek-V3's 1x128 activation tiles)


def tile_width(k: int) -> int:
    """Columns per scale of gate and up: 128, or the whole row when 128 does not divide it."""
    return TILE if k % TILE == 0 else k


def quantize_tiles(t: Tensor) -> tuple[Tensor, Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 [M, K / tile_width(K)]): power-of-two scales along each row's tiles."""
    m, k = t.shape
    tiles = k // tile_width(k)
    q, scale = quant.quantize(t.reshape(m, tiles, tile_width(k)), -1)
    return q.reshape(m, k), scale.reshape(m, tiles)  # explicit sizes: m may be 0 (an EP rank receiving no rows)


def dequantize_tiles(q: Tensor, scale: Tensor) -> Tensor:
    """quantize_tiles' inverse, exact (power-of-two scales): fp32 [M, K]."""
    m, k = q.shape
    tiles = scale.shape[1]
    return (q.float().reshape(m, tiles, k // tiles) * scale.reciprocal().unsqueeze(-1)).reshape(m, k)


def forward(gate: Tensor, up: Tensor, row_weight: Tensor | None, kernel: str) -> tuple[Tensor, ...]:
    """(h_q, h_scale [M, 1], gate_q, gate_scale, up_q, up_scale) of h = silu(gate) * up, times row_weight [M, 1]
    when given (the routing weights weights_before_gemm moved onto w2's input: bf16(float(h) * w), as it does)."""
    if kernel != "emulated" and gate.is_cuda and gate.shape[0]:
        from .triton_swiglu import swiglu_rows

        return swiglu_rows(gate, up, row_weight, tile_width(gate.shape[1]))
    h = _silu_times(gate.float(), up.float())
    if row_weight is not None:
        h = (h.float() * row_weight.float()).to(torch.bfloat16)
    return (*quant.quantize(h, -1), *quantize_tiles(gate), *quantize_tiles(up))


def _silu_times(g: Tensor, u: Tensor) -> Tensor:
    return (g * torch.sigmoid(g) * u).to(torch.bfloat16)  # the model's h is a BF16 tensor


def backward(grad_x: Tensor, gate_q: Tensor, gate_scale: Tensor, up_q: Tensor, up_scale: Tensor,
             row_weight: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """(grad_gate, grad_up, grad_row_weight) from the saved FP8 gate and up: plain torch, which Inductor fuses into
    one kernel with grad_x's producer and the dgrads' quantization."""
    g, u, dh = dequantize_tiles(gate_q, gate_scale), dequantize_tiles(up_q, up_scale), grad_x.float()
    grad_weight = None
    if row_weight is not None:
        grad_weight = (dh * _silu_times(g, u).float()).sum(-1, keepdim=True).to(row_weight.dtype)
        dh = dh * row_weight.float()
    sig = torch.sigmoid(g)
    grad_up = dh * g * sig
    grad_gate = dh * u * sig * (1 + g * (1 - sig))
    return grad_gate.to(dtype), grad_up.to(dtype), grad_weight
