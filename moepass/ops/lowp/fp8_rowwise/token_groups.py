"""moepass::fp8_rowwise_token_group_cols: a grouped wgrad operand, quantized per (token group, column), padded.

The grouped GEMM's wgrad takes grad_out and x each scaled along its token group's tokens, in the padded
layout torch._scaled_grouped_mm's 2d-2d form needs (triton_kernels.token_group_cols_padded). As a
functional op of its own, not hidden inside the wgrad op, two quantizations of the same tensor become two
equal graph nodes that AOTAutograd's CSE merges: an MoE's w1 and w3 read the same permuted tokens x, so
their wgrads share one quantization of x (the largest wgrad operand at DeepSeek-V3 dims, dim 7168).
On CUDA the Triton kernel; elsewhere the same layout in plain torch from quant.token_group_cols
(for CPU tests of the graphs that call it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import E4M3
from ..formats import FP8_ALIGN as ALIGN
from . import quant
from .triton_kernels import padded_token_rows


@torch.library.custom_op("moepass::fp8_rowwise_token_group_cols", mutates_args=())
def fp8_rowwise_token_group_cols(t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """t [M, D] bf16, offs int32 [E] -> (q [D, P] row-major, scale [E, D], padded group ends int32 [E]).

    Group g holds t[offs[g-1]:offs[g]], starting at padded_ends[g-1], zero-padded to a multiple of 16 rows
    (at least 16). Columns past padded_ends[-1] are not written: no GEMM reads them.
    """
    if t.device.type == "cuda":
        from .triton_kernels import token_group_cols_padded

        return token_group_cols_padded(t, offs)
    return _padded_reference(t, offs)


@fp8_rowwise_token_group_cols.register_fake
def _(t: Tensor, offs: Tensor):
    tokens, d = t.shape
    experts = offs.shape[0]
    return (t.new_empty(d, padded_token_rows(tokens, experts), dtype=E4M3),
            t.new_empty(experts, d, dtype=torch.float32), offs.new_empty(experts, dtype=torch.int32))


def _padded_reference(t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, scale = quant.token_group_cols(t, offs)
    ends = offs.tolist()
    sizes = [end - begin for begin, end in zip([0, *ends[:-1]], ends)]
    padded_sizes = [max(-(-size // ALIGN) * ALIGN, ALIGN) for size in sizes]
    q_t = torch.zeros(t.shape[1], padded_token_rows(t.shape[0], len(ends)), dtype=torch.uint8, device=t.device)
    begin = padded_begin = 0
    for size, padded_size in zip(sizes, padded_sizes):
        q_t[:, padded_begin:padded_begin + size] = q[begin:begin + size].t().view(torch.uint8)
        begin, padded_begin = begin + size, padded_begin + padded_size
    padded_ends = torch.tensor(padded_sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(t.device)
    return q_t.view(E4M3), scale, padded_ends
