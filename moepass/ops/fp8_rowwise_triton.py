"""The two Triton kernels of the FP8-rowwise grouped GEMM that torchao does not have.

token_group_cols_padded: [M, D] -> e4m3 [D, P] with one scale per (token group, column), each group
  starting at a multiple of 16 and zero-padded to a multiple of 16 (at least 16). It is the wgrad's
  operand layout: torch._scaled_grouped_mm's 2d-2d form needs 16-byte-aligned, non-empty groups, and
  quantizing straight into that layout costs no extra pass over the tokens. A variant parallel over
  the whole token dim (row chunks, amax through integer atomics, then a cast kernel walking the padded
  layout), meant to fix this one's load imbalance under skewed routing, ran 2.8x slower on an H200
  (examples/results/token_group_quant_h200_two_kernels_rejected.json).
zero_rows_from_group_end_: torch._scaled_grouped_mm leaves output rows at or after offs[-1] unwritten.
Same numerics as fp8_rowwise_quant (power-of-two scales from the amax, e4m3 round-to-nearest-even).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import E4M3, E4M3_MAX
from .formats import FP8_ALIGN as ALIGN
from .fp8_rowwise_quant import AMAX_EPS

# 128 rows per step: 2-31% faster than 64 on an H200, most under skewed routing (a few large groups, each
# walked by few programs); examples/results/token_group_quant_h200.json
BLOCK_M, BLOCK_D = 128, 64

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: the emulated kernel never calls into this module
    triton = None

if triton is not None:

    @triton.jit
    def _token_group_cols_kernel(in_ptr, stride_in_m, stride_in_d, offs_ptr, out_ptr, stride_out_d, scale_ptr,
                                 padded_ends_ptr, D, E, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                                 ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_D: tl.constexpr):
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
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
        scale = (FP8_MAX / tl.maximum(amax.to(tl.float64), EPS)).to(tl.float32)
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # floor to 2^k
        tl.store(scale_ptr + g * D + cols, scale, mask=col_ok)

        for r in range(0, padded_size, BLOCK_M):
            rows = r + tl.arange(0, BLOCK_M)
            src = in_ptr + (start + rows)[:, None].to(tl.int64) * stride_in_m + cols[None, :] * stride_in_d
            x = tl.load(src, mask=(rows < size)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            q = tl.clamp(x * scale[None, :], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
            dst = out_ptr + cols[None, :].to(tl.int64) * stride_out_d + (padded_start + rows)[:, None]
            tl.store(dst, q, mask=(rows < padded_size)[:, None] & col_ok[None, :])

    @triton.jit
    def _zero_rows_kernel(out_ptr, stride_m, offs_ptr, E, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        end = tl.load(offs_ptr + E - 1)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = ((rows >= end) & (rows < M))[:, None] & (cols < N)[None, :]
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :], zeros, mask=keep)


def padded_token_rows(tokens: int, experts: int) -> int:
    """Rows of the padded layout: each group grows by at most ALIGN rows (an empty one by exactly ALIGN)."""
    return (tokens + ALIGN * experts + ALIGN - 1) // ALIGN * ALIGN


def token_group_cols_padded(t: Tensor, offs: Tensor, block_m: int = BLOCK_M, block_d: int | None = None,
                            num_warps: int = 4) -> tuple[Tensor, Tensor, Tensor]:
    """[M, D] -> (q [D, P] row-major, scale [E, D], padded group ends int32 [E]); padding columns are zero.

    One program per (column block, token group) reads its group twice (amax, then cast). block_m, block_d,
    num_warps: the tile, for examples/bench_token_group_quant.py; block_d None: 64, or 32 with few programs.
    """
    tokens, d = t.shape
    experts = offs.shape[0]
    q_t = torch.empty(d, padded_token_rows(tokens, experts), dtype=E4M3, device=t.device)
    scale = torch.empty(experts, d, dtype=torch.float32, device=t.device)
    padded_ends = torch.empty(experts, dtype=torch.int32, device=t.device)
    if block_d is None:
        block_d = BLOCK_D if triton.cdiv(d, BLOCK_D) * experts >= 512 else BLOCK_D // 2  # few experts: more programs
    _token_group_cols_kernel[(triton.cdiv(d, block_d), experts)](
        t, t.stride(0), t.stride(1), offs, q_t, q_t.stride(0), scale, padded_ends, d, experts,
        FP8_MAX=E4M3_MAX, EPS=AMAX_EPS, ALIGN=ALIGN, BLOCK_E=triton.next_power_of_2(experts),
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps)
    return q_t, scale, padded_ends


def zero_rows_from_group_end_(out: Tensor, offs: Tensor) -> Tensor:
    """Zero out[offs[-1]:] in place without reading offs on the host."""
    m, n = out.shape
    if m:
        _zero_rows_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 256))](
            out, out.stride(0), offs, offs.shape[0], m, n, BLOCK_M=64, BLOCK_N=256)
    return out
