"""The Triton kernels of the FP8-rowwise both-layouts quantization, which torchao does not have.

both_layouts: [E, R, C] -> e4m3 along C (row-major) and along R (written transposed, [E, C, R]) from two reads
  of the input: the expert weights' forward and dgrad layouts at once, or (E = 1) a linear's gradient per token
  and per channel (both_layouts.py, the ops around it). The first read writes each tile's row and column amaxes to
  small partial buffers that torch reduces. The kernel before it walked whole rows and gathered the column amax
  through float atomics: on a linear's [16384, C] operand 512 programs hit every column address, and the op took
  longer (examples/results/both_layouts_tile_amax_h200/).
Same numerics as quant (power-of-two scales from the amax, e4m3 round-to-nearest-even).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...formats import E4M3, E4M3_MAX
from ..quant import scale_from_amax

# both_layouts' tile: the fastest of six on an H200 (examples/results/expert_weight_quant_h200.json)
BOTH_BLOCK_R, BOTH_BLOCK_C = 128, 64
# the amax pass's tile: AMAX_TILE_R rows (read AMAX_LOAD_R at a time) x AMAX_TILE_C columns per program; the
# fastest of six on an H200 at every DeepSeek-V3 operand timed (examples/results/both_layouts_tile_amax_h200/)
AMAX_TILE_R, AMAX_LOAD_R, AMAX_TILE_C = 256, 64, 64

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: the emulated kernel never calls into this module
    triton = None

if triton is not None:

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
