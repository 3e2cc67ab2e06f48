"""The Triton kernel of the FP8-rowwise SwiGLU (swiglu.py): one program per row reads gate and up once and writes
h's e4m3 row and scale, and gate and up in e4m3 with one scale per tile. Its reference is swiglu.forward's torch path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...formats import E4M3, E4M3_MAX
from ..quant import AMAX_EPS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: swiglu.forward never calls into this module there
    triton = None

if triton is not None:

    @triton.jit
    def _pow2_scale(amax, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
        scale = (FP8_MAX / tl.maximum(amax.to(tl.float64), EPS)).to(tl.float32)
        return (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # floor to 2^k

    @triton.jit
    def _swiglu_rows_kernel(gate_ptr, stride_gm, stride_gk, up_ptr, stride_um, stride_uk, weight_ptr, stride_w,
                            h_q_ptr, h_scale_ptr, gate_q_ptr, gate_scale_ptr, up_q_ptr, up_scale_ptr, TILES,
                            WEIGHTED: tl.constexpr, TILE: tl.constexpr, TILES_P: tl.constexpr, TILE_P: tl.constexpr,
                            FP8_MAX: tl.constexpr, EPS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tiles = tl.arange(0, TILES_P)
        cols = tiles[:, None] * TILE + tl.arange(0, TILE_P)[None, :]  # [TILES_P, TILE_P]: the row as its tiles
        ok = (tiles < TILES)[:, None] & (tl.arange(0, TILE_P) < TILE)[None, :]
        g = tl.load(gate_ptr + row * stride_gm + cols * stride_gk, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_um + cols * stride_uk, mask=ok, other=0.0).to(tl.float32)
        out = row * TILES * TILE + cols  # the outputs are contiguous [M, K]

        h = (g * tl.sigmoid(g) * u).to(tl.bfloat16).to(tl.float32)  # the model's h is BF16
        if WEIGHTED:  # the routing weight on w2's input, rounded to BF16 as the model's product is
            h = (h * tl.load(weight_ptr + row * stride_w).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        h_scale = _pow2_scale(tl.max(tl.max(tl.abs(h), axis=1), axis=0), FP8_MAX, EPS)
        tl.store(h_scale_ptr + row, h_scale)
        tl.store(h_q_ptr + out, tl.clamp(h * h_scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv), mask=ok)

        g_scale = _pow2_scale(tl.max(tl.abs(g), axis=1), FP8_MAX, EPS)  # [TILES_P]
        tl.store(gate_scale_ptr + row * TILES + tiles, g_scale, mask=tiles < TILES)
        tl.store(gate_q_ptr + out, tl.clamp(g * g_scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv), mask=ok)
        u_scale = _pow2_scale(tl.max(tl.abs(u), axis=1), FP8_MAX, EPS)
        tl.store(up_scale_ptr + row * TILES + tiles, u_scale, mask=tiles < TILES)
        tl.store(up_q_ptr + out, tl.clamp(u * u_scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv), mask=ok)


def swiglu_rows(gate: Tensor, up: Tensor, row_weight: Tensor | None, tile: int) -> tuple[Tensor, ...]:
    """gate, up [M, K] (any strides), row_weight [M, 1] or None, `tile` columns per scale (dividing K) -> (h_q,
    h_scale [M, 1], gate_q, gate_scale [M, K / tile], up_q, up_scale [M, K / tile])."""
    m, k = gate.shape
    tiles = k // tile
    h_q, gate_q, up_q = (torch.empty(m, k, dtype=E4M3, device=gate.device) for _ in range(3))
    h_scale = torch.empty(m, 1, dtype=torch.float32, device=gate.device)
    gate_scale, up_scale = (torch.empty(m, tiles, dtype=torch.float32, device=gate.device) for _ in range(2))
    tiles_p, tile_p = triton.next_power_of_2(tiles), triton.next_power_of_2(tile)
    weight, stride_w = (gate, 0) if row_weight is None else (row_weight, row_weight.stride(0))  # unread: WEIGHTED
    _swiglu_rows_kernel[(m,)](
        gate, gate.stride(0), gate.stride(1), up, up.stride(0), up.stride(1), weight, stride_w,
        h_q, h_scale, gate_q, gate_scale, up_q, up_scale, tiles, WEIGHTED=row_weight is not None, TILE=tile,
        TILES_P=tiles_p, TILE_P=tile_p, FP8_MAX=E4M3_MAX, EPS=AMAX_EPS, num_warps=8 if tiles_p * tile_p >= 4096 else 4)
    return h_q, h_scale, gate_q, gate_scale, up_q, up_scale
