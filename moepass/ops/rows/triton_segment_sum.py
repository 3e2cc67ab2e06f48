"""The Triton kernel of moepass::segment_sum_rows (segment_sum.py holds the op and its contract).

The rows are sorted by index (a stable sort: each output row adds its rows in their order, so runs agree bit for bit),
and one program per (output row, column block) walks its row's segment of the sorted order. Each source row is read
once and each output row written once; Inductor's lowering of the same scatter-add zeroes the output, then adds every
element into it atomically.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: the op's torch path never calls into this module
    triton = None

BLOCK_D = 1024  # 8 BF16 elements a thread at 4 warps: 16-byte loads

if triton is not None:

    @triton.jit
    def _segment_sum_rows_kernel(src0, src1, src2, src3, stride0, stride1, stride2, stride3, order_ptr, starts_ptr,
                                 ends_ptr, out_ptr, D, NUM_SRCS: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        start = tl.load(starts_ptr + row)
        end = tl.load(ends_ptr + row)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(start, end):
            r = tl.load(order_ptr + j).to(tl.int64)
            acc += tl.load(src0 + r * stride0 + cols, mask=col_ok, other=0.0).to(tl.float32)
            if NUM_SRCS > 1:
                acc += tl.load(src1 + r * stride1 + cols, mask=col_ok, other=0.0).to(tl.float32)
            if NUM_SRCS > 2:
                acc += tl.load(src2 + r * stride2 + cols, mask=col_ok, other=0.0).to(tl.float32)
            if NUM_SRCS > 3:
                acc += tl.load(src3 + r * stride3 + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * D + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def segments(index: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order, starts, ends): index[order] ascending (stable); the rows of output row i are order[starts[i]:ends[i]].
    Indices outside [0, n) fall in no segment."""
    sorted_index, order = torch.sort(index, stable=True)
    rows = torch.arange(n, device=index.device, dtype=sorted_index.dtype)
    return (order, torch.searchsorted(sorted_index, rows), torch.searchsorted(sorted_index, rows, right=True))


def segment_sum_rows(srcs: list[Tensor], index: Tensor, n: int, dtype: torch.dtype,
                     block_d: int | None = None) -> Tensor:
    """moepass::segment_sum_rows on the GPU (or under Triton's interpreter): srcs [M, D], index [M] in [0, n)."""
    srcs = [s if s.stride(1) == 1 else s.contiguous() for s in srcs]
    d = srcs[0].shape[1]
    out = torch.empty(n, d, dtype=dtype, device=srcs[0].device)
    if n == 0 or d == 0:
        return out
    order, starts, ends = segments(index, n)
    padded = srcs + [srcs[0]] * (4 - len(srcs))
    block_d = block_d or min(BLOCK_D, triton.next_power_of_2(d))
    _segment_sum_rows_kernel[(n, triton.cdiv(d, block_d))](
        *padded, *(s.stride(0) for s in padded), order, starts, ends, out, d,
        NUM_SRCS=len(srcs), BLOCK_D=block_d, num_warps=4 if block_d >= 512 else 2)
    return out
