"""The Triton kernel of the FP8-rowwise grouped wgrad's operand layout, which torchao does not have.

token_group_cols_padded: [M, D] -> e4m3 [D, P] with one scale per (token group, column), each group
  starting at a multiple of 16 and zero-padded to a multiple of 16 (at least 16). It is the wgrad's
  operand layout: torch._scaled_grouped_mm's 2d-2d form needs 16-byte-aligned, non-empty groups, and
  quantizing straight into that layout costs no extra pass over the tokens. A variant parallel over
  the whole token dim (row chunks, amax through integer atomics, then a cast kernel walking the padded
  layout), meant to fix this one's load imbalance under skewed routing, ran slower on an H200
  (examples/results/token_group_quant_h200_two_kernels_rejected.json).
Same numerics as quant (power-of-two scales from the amax, e4m3 round-to-nearest-even); its reference is
quant.token_group_cols_padded, the op around it token_group_cols.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...formats import E4M3, E4M3_MAX
from ..quant import ALIGN, AMAX_EPS, padded_token_rows

# 128 rows per step: faster than 64 on an H200, most under skewed routing (a few large groups, each
# walked by few programs); examples/results/token_group_quant_h200.json
BLOCK_M, BLOCK_D = 128, 64

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: the emulated kernel never calls into this module
    triton = None

if triton is not None:

    @triton.jit
    def _token_group_cols_kernel(in_ptr, stride_in_m, stride_in_d, row_mult_ptr, offs_ptr, out_ptr, stride_out_d,
                                 scale_ptr, padded_ends_ptr, D, E, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                                 ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_D: tl.constexpr, ROW_SCALED: tl.constexpr):
        # ROW_SCALED: in_ptr holds e4m3 rows, each multiplied by row_mult[row] on load (their exact dequantization)
        pid_d = tl.program_id(0)
        g = tl.program_id(1)
        # This group's padded start: the padded sizes of the groups before it, summed.
        e_idx = tl.arange(0, BLOCK_E)
        ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=0)
        begins = tl.load(offs_ptr + e_idx - 1, mask=(e_idx > 0) & (e_idx < E), other=0)
        padded_sizes = tl.maximum((ends - begins + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
        padded_start = tl.sum(tl.where(e_idx < g, padded_sizes, 0), axis=0)
        start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        size = tl.load(offs_ptr + g) - start
        padded_size = tl.maximum((size + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
        if pid_d == 0:
            tl.store(padded_ends_ptr + g, padded_start + padded_size)

        cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        amax = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for r in range(0, size, BLOCK_M):
            rows = r + tl.arange(0, BLOCK_M)
            src = in_ptr + (start + rows)[:, None].to(tl.int64) * stride_in_m + cols[None, :] * stride_in_d
            x = tl.load(src, mask=(rows < size)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if ROW_SCALED:
                x = x * tl.load(row_mult_ptr + start + rows, mask=rows < size, other=0.0)[:, None]
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        scale = (FP8_MAX / tl.maximum(amax.to(tl.float64), EPS)).to(tl.float32)
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # floor to 2^k
        tl.store(scale_ptr + g * D + cols, scale, mask=col_ok)

        for r in range(0, padded_size, BLOCK_M):
            rows = r + tl.arange(0, BLOCK_M)
            src = in_ptr + (start + rows)[:, None].to(tl.int64) * stride_in_m + cols[None, :] * stride_in_d
            x = tl.load(src, mask=(rows < size)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if ROW_SCALED:
                x = x * tl.load(row_mult_ptr + start + rows, mask=rows < size, other=0.0)[:, None]
            q = tl.clamp(x * scale[None, :], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
            dst = out_ptr + cols[None, :].to(tl.int64) * stride_out_d + (padded_start + rows)[:, None]
            tl.store(dst, q, mask=(rows < padded_size)[:, None] & col_ok[None, :])


def token_group_cols_padded(t: Tensor, offs: Tensor, row_scale: Tensor | None = None, block_m: int = BLOCK_M,
                            block_d: int | None = None, num_warps: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """[M, D] -> (q [D, P] row-major, scale [E, D], padded group ends int32 [E]); padding columns are zero.

    t: bf16, or e4m3 rows with row_scale [M, 1] (quant.rows' scales), read as their dequantization
    quant.dequantize(t, row_scale) without writing it: 1 byte per element read instead of 2, bit for bit the same.
    One program per (column block, token group) reads its group twice (amax, then cast). block_m, block_d,
    num_warps: the tile, for examples/bench_token_group_quant.py; block_d None: 64, or 32 with few programs.
    """
    tokens, d = t.shape
    experts = offs.shape[0]
    q_t = torch.empty(d, padded_token_rows(tokens, experts), dtype=E4M3, device=t.device)
    scale = torch.empty(experts, d, dtype=torch.float32, device=t.device)
    padded_ends = torch.empty(experts, dtype=torch.int32, device=t.device)
    # FP8 rows: quant.dequantize's multiplier, from the same torch op, so the values are its own; BF16: unread
    row_mult = scale if row_scale is None else row_scale.reshape(tokens).reciprocal()
    if block_d is None:
        block_d = BLOCK_D if triton.cdiv(d, BLOCK_D) * experts >= 512 else BLOCK_D // 2  # few experts: more programs
    _token_group_cols_kernel[(triton.cdiv(d, block_d), experts)](
        t, t.stride(0), t.stride(1), row_mult, offs, q_t, q_t.stride(0), scale, padded_ends, d, experts,
        FP8_MAX=E4M3_MAX, EPS=AMAX_EPS, ALIGN=ALIGN, BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_M=block_m, BLOCK_D=block_d, ROW_SCALED=row_scale is not None, num_warps=num_warps)
    return q_t, scale, padded_ends
