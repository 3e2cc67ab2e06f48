"""The two Triton kernels of the FP8-rowwise grouped GEMM that torchao does not have.

token_group_cols_padded: [M, D] -> e4m3 [D, P] with one scale per (token group, column), each group
  starting at a multiple of 16 and zero-padded to a multiple of 16 (at least 16). It is the wgrad's
  operand layout: torch._scaled_grouped_mm's 2d-2d form needs 16-byte-aligned, non-empty groups, and
  quantizing straight into that layout costs no extra pass over the tokens.
  Two kernels, each parallel over (row chunk, column block) of the whole token dim: the amax kernel folds
  each chunk into its groups' column amax with integer atomics (|x| >= 0, so its float bits order like
  ints); the cast kernel walks the padded layout, so padding rows are written as zeros on the way.
  One program per (group, column block) looping over the group's rows was 2-3x slower on an H200:
  too few programs in flight, and load-imbalanced by the routing.
zero_rows_from_group_end_: torch._scaled_grouped_mm leaves output rows at or after offs[-1] unwritten.
Same numerics as fp8_rowwise_quant (power-of-two scales from the amax, e4m3 round-to-nearest-even).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fp8_rowwise_quant import AMAX_EPS, E4M3, E4M3_MAX

ALIGN = 16
# (rows per program, columns per program, warps): chosen with examples/bench_token_group_quant.py on an H200
CHUNK_M, BLOCK_D, NUM_WARPS = 64, 128, 4

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: the emulated kernel never calls into this module
    triton = None

if triton is not None:

    @triton.jit
    def _group_col_amax_kernel(in_ptr, stride_in_m, stride_in_d, offs_ptr, amax_bits_ptr, D, E,
                               BLOCK_E: tl.constexpr, CHUNK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        r0 = tl.program_id(0) * CHUNK_M
        e_idx = tl.arange(0, BLOCK_E)
        ends = tl.load(offs_ptr + e_idx, mask=e_idx < E, other=2147483647)
        r_last = tl.minimum(r0 + CHUNK_M, tl.load(offs_ptr + E - 1)) - 1  # rows past offs[-1]: no group
        if r_last >= r0:
            rows = r0 + tl.arange(0, CHUNK_M)
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            src = in_ptr + rows[:, None].to(tl.int64) * stride_in_m + cols[None, :] * stride_in_d
            a = tl.abs(tl.load(src, mask=(rows <= r_last)[:, None] & col_ok[None, :], other=0.0).to(tl.float32))
            # groups overlapping this chunk: usually one, two at a boundary
            for g in range(tl.sum((ends <= r0).to(tl.int32), axis=0), tl.sum((ends <= r_last).to(tl.int32), axis=0) + 1):
                start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
                in_g = (rows >= start) & (rows < tl.load(offs_ptr + g))
                amax = tl.max(tl.where(in_g[:, None], a, 0.0), axis=0)
                tl.atomic_max(amax_bits_ptr + g * D + cols, amax.to(tl.int32, bitcast=True), mask=col_ok,
                              sem="relaxed")

    @triton.jit
    def _group_col_cast_kernel(in_ptr, stride_in_m, stride_in_d, offs_ptr, amax_ptr, out_ptr, stride_out_d,
                               scale_ptr, padded_ends_ptr, D, E, FP8_MAX: tl.constexpr, EPS: tl.constexpr,
                               ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_M: tl.constexpr,
                               BLOCK_D: tl.constexpr):
        p0 = tl.program_id(0) * CHUNK_M
        e_idx = tl.arange(0, BLOCK_E)
        in_e = e_idx < E
        ends = tl.load(offs_ptr + e_idx, mask=in_e, other=0)
        begins = tl.load(offs_ptr + e_idx - 1, mask=(e_idx > 0) & in_e, other=0)
        padded_sizes = tl.where(in_e, tl.maximum((ends - begins + ALIGN - 1) // ALIGN * ALIGN, ALIGN), 0)
        padded_ends = tl.cumsum(padded_sizes, axis=0)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(padded_ends_ptr + e_idx, padded_ends, mask=in_e)
        p_last = tl.minimum(p0 + CHUNK_M, tl.sum(padded_sizes, axis=0)) - 1
        if p_last >= p0:
            p_ends = tl.where(in_e, padded_ends, 2147483647)
            prows = p0 + tl.arange(0, CHUNK_M)
            cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
            col_ok = cols < D
            for g in range(tl.sum((p_ends <= p0).to(tl.int32), axis=0), tl.sum((p_ends <= p_last).to(tl.int32), axis=0) + 1):
                p_end = tl.sum(tl.where(e_idx == g, padded_ends, 0), axis=0)
                p_start = p_end - tl.sum(tl.where(e_idx == g, padded_sizes, 0), axis=0)
                start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
                size = tl.load(offs_ptr + g) - start
                amax = tl.load(amax_ptr + g * D + cols, mask=col_ok, other=0.0)
                scale = (FP8_MAX / tl.maximum(amax.to(tl.float64), EPS)).to(tl.float32)
                scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)  # floor to 2^k
                if p_start >= p0:  # the chunk holding the group's first row writes its scales
                    tl.store(scale_ptr + g * D + cols, scale, mask=col_ok)
                local = prows - p_start
                in_g = (prows >= p_start) & (prows < p_end)
                src = in_ptr + (start + local)[:, None].to(tl.int64) * stride_in_m + cols[None, :] * stride_in_d
                x = tl.load(src, mask=(in_g & (local < size))[:, None] & col_ok[None, :], other=0.0)
                q = tl.clamp(x.to(tl.float32) * scale[None, :], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
                dst = out_ptr + cols[None, :].to(tl.int64) * stride_out_d + prows[:, None]
                tl.store(dst, q, mask=in_g[:, None] & col_ok[None, :])

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


def token_group_cols_padded(t: Tensor, offs: Tensor, chunk_m: int = CHUNK_M, block_d: int = BLOCK_D,
                            num_warps: int = NUM_WARPS) -> tuple[Tensor, Tensor, Tensor]:
    """[M, D] -> (q [D, P] row-major, scale [E, D], padded group ends int32 [E]); padding columns are zero.

    chunk_m, block_d, num_warps: tile shape, for the benchmark that chose the defaults.
    """
    tokens, d = t.shape
    experts = offs.shape[0]
    q_t = torch.empty(d, padded_token_rows(tokens, experts), dtype=E4M3, device=t.device)
    scale = torch.empty(experts, d, dtype=torch.float32, device=t.device)
    padded_ends = torch.empty(experts, dtype=torch.int32, device=t.device)
    amax_bits = torch.zeros(experts, d, dtype=torch.int32, device=t.device)
    block_e, col_blocks = triton.next_power_of_2(experts), triton.cdiv(d, block_d)
    if tokens:
        _group_col_amax_kernel[(triton.cdiv(tokens, chunk_m), col_blocks)](
            t, t.stride(0), t.stride(1), offs, amax_bits, d, experts,
            BLOCK_E=block_e, CHUNK_M=chunk_m, BLOCK_D=block_d, num_warps=num_warps)
    _group_col_cast_kernel[(triton.cdiv(q_t.shape[1], chunk_m), col_blocks)](
        t, t.stride(0), t.stride(1), offs, amax_bits.view(torch.float32), q_t, q_t.stride(0), scale, padded_ends,
        d, experts, FP8_MAX=E4M3_MAX, EPS=AMAX_EPS, ALIGN=ALIGN, BLOCK_E=block_e, CHUNK_M=chunk_m,
        BLOCK_D=block_d, num_warps=num_warps)
    return q_t, scale, padded_ends


def zero_rows_from_group_end_(out: Tensor, offs: Tensor) -> Tensor:
    """Zero out[offs[-1]:] in place without reading offs on the host."""
    m, n = out.shape
    if m:
        _zero_rows_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 256))](
            out, out.stride(0), offs, offs.shape[0], m, n, BLOCK_M=64, BLOCK_N=256)
    return out
