"""The Triton kernels of the FP8-rowwise grouped GEMM that torchao does not have.

token_group_cols_padded: [M, D] -> e4m3 [D, P] with one scale per (token group, column), each group
  starting at a multiple of 16 and zero-padded to a multiple of 16 (at least 16). It is the wgrad's
  operand layout: torch._scaled_grouped_mm's 2d-2d form needs 16-byte-aligned, non-empty groups, and
  quantizing straight into that layout costs no extra pass over the tokens. A variant parallel over
  the whole token dim (row chunks, amax through integer atomics, then a cast kernel walking the padded
  layout), meant to fix this one's load imbalance under skewed routing, ran slower on an H200
  (examples/results/token_group_quant_h200_two_kernels_rejected.json).
zero_rows_from_group_end_: torch._scaled_grouped_mm leaves output rows at or after offs[-1] unwritten.
both_layouts: [E, R, C] -> e4m3 along C (row-major) and along R (written transposed, [E, C, R]) from two reads
  of the input: the expert weights' forward and dgrad layouts at once, or (E = 1) a linear's gradient per token
  and per channel (both_layouts). The first read writes each tile's row and column amaxes to small partial
  buffers that torch reduces. The kernel before it walked whole rows and gathered the column amax through float
  atomics: on a linear's [16384, C] operand 512 programs hit every column address, and the op took longer
  (examples/results/both_layouts_tile_amax_h200/).
Same numerics as quant (power-of-two scales from the amax, e4m3 round-to-nearest-even).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import E4M3, E4M3_MAX
from .quant import ALIGN, AMAX_EPS, scale_from_amax

# both_layouts' tile: the fastest of six on an H200 (examples/results/expert_weight_quant_h200.json)
BOTH_BLOCK_R, BOTH_BLOCK_C = 128, 64
# the amax pass's tile: AMAX_TILE_R rows (read AMAX_LOAD_R at a time) x AMAX_TILE_C columns per program; the
# fastest of six on an H200 at every DeepSeek-V3 operand timed (examples/results/both_layouts_tile_amax_h200/)
AMAX_TILE_R, AMAX_LOAD_R, AMAX_TILE_C = 256, 64, 64
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

    @triton.jit
    def _tile_amax_kernel(in_ptr, row_part_ptr, col_part_ptr, R, C, TILE_R: tl.constexpr, LOAD_R: tl.constexpr,
                          TILE_C: tl.constexpr):
        # one program per (row tile, column tile, expert): its columns' amax over its TILE_R rows goes to
        # col_part[e, pid_r, :], its rows' amax over its TILE_C columns to row_part[e, pid_c, :] (no atomics)
        pid_r, pid_c, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_r, n_c = tl.num_programs(0), tl.num_programs(1)
        cols = pid_c * TILE_C + tl.arange(0, TILE_C)
        col_ok = cols < C
        base = in_ptr + e.to(tl.int64) * R * C
        row_part = row_part_ptr + (e * n_c + pid_c).to(tl.int64) * R
        col_amax = tl.zeros((TILE_C,), dtype=tl.float32)
        for r0 in tl.static_range(0, TILE_R, LOAD_R):
            rows = pid_r * TILE_R + r0 + tl.arange(0, LOAD_R)
            x = tl.load(base + rows[:, None].to(tl.int64) * C + cols[None, :],  # 64-bit: past 2^31 elements
                        mask=(rows < R)[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            x = tl.abs(x)
            col_amax = tl.maximum(col_amax, tl.max(x, axis=0))
            tl.store(row_part + rows, tl.max(x, axis=1), mask=rows < R)
        tl.store(col_part_ptr + (e * n_r + pid_r).to(tl.int64) * C + cols, col_amax, mask=col_ok)

    @triton.jit
    def _quantize_both_kernel(in_ptr, row_scale_ptr, col_scale_ptr, q_rows_ptr, q_cols_ptr, R, C,
                              FP8_MAX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        pid_r, pid_c, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (cols < C)[None, :]
        offset = e.to(tl.int64) * R * C
        at_rows = offset + rows[:, None].to(tl.int64) * C + cols[None, :]
        x = tl.load(in_ptr + at_rows, mask=mask, other=0.0).to(tl.float32)
        row_scale = tl.load(row_scale_ptr + e * R + rows, mask=rows < R, other=1.0)
        col_scale = tl.load(col_scale_ptr + e * C + cols, mask=cols < C, other=1.0)
        q = tl.clamp(x * row_scale[:, None], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        tl.store(q_rows_ptr + at_rows, q, mask=mask)
        q = tl.clamp(x * col_scale[None, :], -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
        tl.store(q_cols_ptr + offset + cols[:, None].to(tl.int64) * R + rows[None, :], tl.trans(q),
                 mask=tl.trans(mask))

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


def zero_rows_from_group_end_(out: Tensor, offs: Tensor) -> Tensor:
    """Zero out[offs[-1]:] in place without reading offs on the host."""
    m, n = out.shape
    if m:
        _zero_rows_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 256))](
            out, out.stride(0), offs, offs.shape[0], m, n, BLOCK_M=64, BLOCK_N=256)
    return out


def both_layouts(t: Tensor, block_r: int = BOTH_BLOCK_R, block_c: int = BOTH_BLOCK_C
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Contiguous [E, R, C] -> (q_rows [E, R, C], scale [E, R]) along C and (q_cols [E, C, R], scale [E, C]) along R.

    The scales come from quant.scale_from_amax between the two kernels, so they are the reference's
    bit for bit and the kernel quantizes with exactly the scales it returns. block_r, block_c: the quantize pass's
    tile (the amax pass's is tile_amax's).
    """
    experts, r, c = t.shape
    row_amax, col_amax = tile_amax(t)
    row_scale, col_scale = scale_from_amax(row_amax), scale_from_amax(col_amax)
    q_rows = torch.empty(experts, r, c, device=t.device, dtype=E4M3)
    q_cols = torch.empty(experts, c, r, device=t.device, dtype=E4M3)
    _quantize_both_kernel[(triton.cdiv(r, block_r), triton.cdiv(c, block_c), experts)](
        t, row_scale, col_scale, q_rows, q_cols, r, c, FP8_MAX=E4M3_MAX, BLOCK_R=block_r, BLOCK_C=block_c)
    return q_rows, row_scale, q_cols, col_scale


def tile_amax(t: Tensor, tile_r: int = AMAX_TILE_R, load_r: int = AMAX_LOAD_R, tile_c: int = AMAX_TILE_C
              ) -> tuple[Tensor, Tensor]:
    """Contiguous [E, R, C] -> (amax of |t| along C [E, R], along R [E, C]), exact (a max is order-free)."""
    experts, r, c = t.shape
    grid = (triton.cdiv(r, tile_r), triton.cdiv(c, tile_c), experts)
    row_part = torch.empty(experts, grid[1], r, device=t.device, dtype=torch.float32)
    col_part = torch.empty(experts, grid[0], c, device=t.device, dtype=torch.float32)
    _tile_amax_kernel[grid](t, row_part, col_part, r, c, TILE_R=tile_r, LOAD_R=load_r, TILE_C=tile_c)
    return row_part.amax(dim=1), col_part.amax(dim=1)
