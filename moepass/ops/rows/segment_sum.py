"""moepass::segment_sum_rows: out[i] = sum of (srcs[0] + srcs[1] + ...)[j] over the rows j with index[j] == i.

It is what a scatter-add of rows into zeros computes: an MoE's combine (expert outputs added into their tokens,
`zeros.index_add(0, token_of_slot, y)`) and the backward of every gather of token rows (`x[token_of_slot]`), which
AOTAutograd writes as `index_put(zeros, [idx], grad, accumulate=True)`. Inductor lowers those to atomic adds, one per
element, into a zeroed buffer. Here the rows are sorted by index once and each output row sums its own rows: no
atomics, no zeroed buffer, every sum in the same order on every run (deterministic), and several srcs (the dgrads of
w1 and w3) are added on the fly instead of first written as their sum. inductor_stage/segment_sums.py rewrites the
graphs; on CUDA the Triton kernel of triton_segment_sum.py runs, elsewhere the same sum through index_add.

Sums are in fp32, rounded to `dtype` once (an atomic add of BF16 rows rounds at each add). Negative indices count
from the end, as index_put's do.
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("moepass::segment_sum_rows", mutates_args=())
def segment_sum_rows(srcs: list[Tensor], index: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """srcs: 1-4 tensors [M, D] (any float dtypes), index int [M] -> [n, D] in `dtype`."""
    _check(srcs, index, n, dtype)
    index = torch.where(index < 0, index + n, index)
    if srcs[0].is_cuda:
        from .triton_segment_sum import segment_sum_rows as kernel

        return kernel(srcs, index, n, dtype)
    total = srcs[0].float()
    for src in srcs[1:]:
        total = total + src.float()
    return total.new_zeros(n, total.shape[1]).index_add_(0, index, total).to(dtype)


@segment_sum_rows.register_fake
def _(srcs: list[Tensor], index: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    _check(srcs, index, n, dtype)
    return srcs[0].new_empty(n, srcs[0].shape[1], dtype=dtype)


MAX_SRCS = 4


def _check(srcs: list[Tensor], index: Tensor, n: int, dtype: torch.dtype) -> None:
    if not 1 <= len(srcs) <= MAX_SRCS:
        raise ValueError(f"moepass::segment_sum_rows: 1 to {MAX_SRCS} srcs; got {len(srcs)}")
    m, d = srcs[0].shape if srcs[0].dim() == 2 else (None, None)
    for src in srcs:
        if src.dim() != 2 or tuple(src.shape) != (m, d) or not src.dtype.is_floating_point:
            raise ValueError("moepass::segment_sum_rows: srcs must be float tensors [M, D] of one shape; got "
                             f"{[(s.dtype, tuple(s.shape)) for s in srcs]}")
    if index.dim() != 1 or index.shape[0] != m or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moepass::segment_sum_rows: index must be int32 or int64 [{m}] (one per src row); got "
                         f"{index.dtype} {tuple(index.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"moepass::segment_sum_rows: dtype must be a float dtype; got {dtype}")
