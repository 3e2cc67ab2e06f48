"""moepass::fp8_rowwise_expert_weights: an expert weight w_t [E, K, N] in both FP8-rowwise layouts at once.

The grouped GEMM's forward takes w_t per output channel (scaled along K, column-major) and its dgrad per
input channel (scaled along N, row-major): two quantizations of the same weight, in two graphs. Under the
option fp8_rowwise.expert_weights_once, both decompositions (fp8_rowwise_decomp) call this one functional op
on the same w_t, each using its half; AOTAutograd's CSE merges the two calls of the joint graph into one in
the forward, and the partitioner saves the dgrad half for the backward (1 byte per weight element).
On CUDA two Triton kernels read w_t twice in all (fp8_rowwise_triton.both_layouts, bit for bit equal to the
reference, 1.5-1.6x faster than the two compiled quantizations at 671B dims: examples/results/
expert_weight_quant_h200.json); elsewhere, or for an w_t with neither layout contiguous, the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import E4M3
from .fp8_rowwise_decomp import cols, rows


@torch.library.custom_op("moepass::fp8_rowwise_expert_weights", mutates_args=())
def fp8_rowwise_expert_weights(w_t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w_t [E, K, N] bf16 -> (fwd q [E, K, N] column-major, scale [E, 1, N]; dgrad q [E, K, N], scale [E, K, 1]).

    Exactly fp8_rowwise_decomp.cols(w_t) and rows(w_t), the layouts the decomposed grouped GEMMs take.
    """
    if w_t.device.type != "cuda":
        return (*cols(w_t), *rows(w_t))
    from .fp8_rowwise_triton import both_layouts

    if w_t.transpose(-2, -1).is_contiguous():  # the model's [E, N, K] weight, transposed: rows are the forward's
        q_rows, row_scale, q_cols, col_scale = both_layouts(w_t.transpose(-2, -1))
        return q_rows.transpose(-2, -1), row_scale.unsqueeze(1), q_cols, col_scale.unsqueeze(-1)
    q_rows, row_scale, q_cols, col_scale = both_layouts(w_t.contiguous())  # rows along N are the dgrad's
    return q_cols.transpose(-2, -1), col_scale.unsqueeze(1), q_rows, row_scale.unsqueeze(-1)


@fp8_rowwise_expert_weights.register_fake
def _(w_t: Tensor):
    e, k, n = w_t.shape
    fwd_q = w_t.new_empty(e, n, k, dtype=E4M3).transpose(-2, -1)
    return (fwd_q, w_t.new_empty(e, 1, n, dtype=torch.float32), w_t.new_empty(e, k, n, dtype=E4M3),
            w_t.new_empty(e, k, 1, dtype=torch.float32))
