"""An FP8-rowwise operand quantized once into both layouts that its two GEMMs read.

Two operands are quantized twice per step, once for each GEMM that reads them:
- an expert weight w_t [E, K, N]: the grouped forward scales it along K (column-major), the dgrad along N;
- a linear's gradient g [M, N]: the dgrad scales it per token (along N), the wgrad per channel (along tokens);
  likewise a linear's input x [M, K]: the forward per token, the wgrad per channel.
The ops here return both layouts at once. Under the options fp8_rowwise.expert_weights_once and
fp8_rowwise.linear_both_layouts both decompositions (decomp) call one op on the same operand, each
using its half; AOTAutograd's CSE merges the two calls of the joint graph into one, and where the two GEMMs
sit in different graphs the partitioner saves the other half (1 byte per element) for the backward.
On CUDA two Triton kernels read the operand twice in all (triton_both_layouts.both_layouts: each tile's row and
column amaxes, reduced by torch, then one pass writing both e4m3 layouts), bit for bit equal to the reference;
elsewhere the reference (decomp.rows / cols).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...formats import E4M3
from ..decomp import cols, rows


@torch.library.custom_op("moepass::fp8_rowwise_expert_weights", mutates_args=())
def fp8_rowwise_expert_weights(w_t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """w_t [E, K, N] bf16 -> (fwd q [E, K, N] column-major, scale [E, 1, N]; dgrad q [E, K, N], scale [E, K, 1]).

    Exactly decomp.cols(w_t) and rows(w_t), the layouts the decomposed grouped GEMMs take.
    """
    if w_t.device.type != "cuda":
        return (*cols(w_t), *rows(w_t))
    from .triton_both_layouts import both_layouts

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


@torch.library.custom_op("moepass::fp8_rowwise_rows_and_cols", mutates_args=())
def fp8_rowwise_rows_and_cols(t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """t [M, C] bf16 -> (q [M, C] row-major, scale [M, 1]; q [M, C] column-major, scale [1, C]).

    Exactly decomp.rows(t) and cols(t): per row (a GEMM's left operand) and per column (the wgrad's).
    """
    if t.device.type != "cuda" or t.shape[0] == 0:
        return (*rows(t), *cols(t))
    from .triton_both_layouts import both_layouts

    q_rows, row_scale, q_cols_t, col_scale = both_layouts(t.contiguous().unsqueeze(0))
    return q_rows[0], row_scale[0].unsqueeze(-1), q_cols_t[0].t(), col_scale[0].unsqueeze(0)


@fp8_rowwise_rows_and_cols.register_fake
def _(t: Tensor):
    m, c = t.shape
    return (t.new_empty(m, c, dtype=E4M3), t.new_empty(m, 1, dtype=torch.float32),
            t.new_empty(c, m, dtype=E4M3).t(), t.new_empty(1, c, dtype=torch.float32))
