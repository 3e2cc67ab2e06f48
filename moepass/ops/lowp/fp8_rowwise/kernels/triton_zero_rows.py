"""The Triton kernel that zeroes the FP8-rowwise grouped GEMMs' rows after the last token group.

torch._scaled_grouped_mm leaves output rows at or after offs[-1] unwritten; zero_rows_from_group_end_ zeroes them
in place without reading offs on the host (kernel "scaled_mm"'s eager grouped ops: ../grouped_mm.py).
"""

from __future__ import annotations

from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only machines: the emulated kernel never calls into this module
    triton = None

if triton is not None:

    @triton.jit
    def _zero_rows_kernel(out_ptr, stride_m, offs_ptr, E, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        end = tl.load(offs_ptr + E - 1)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        keep = ((rows >= end) & (rows < M))[:, None] & (cols < N)[None, :]
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :], zeros, mask=keep)


def zero_rows_from_group_end_(out: Tensor, offs: Tensor) -> Tensor:
    """Zero out[offs[-1]:] in place without reading offs on the host."""
    m, n = out.shape
    if m:
        _zero_rows_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 256))](
            out, out.stride(0), offs, offs.shape[0], m, n, BLOCK_M=64, BLOCK_N=256)
    return out
