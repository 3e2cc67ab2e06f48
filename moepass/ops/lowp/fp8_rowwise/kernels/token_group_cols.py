"""moepass::fp8_rowwise_token_group_cols: a grouped wgrad operand, quantized per (token group, column), padded.

The grouped GEMM's wgrad takes grad_out and x each scaled along its token group's tokens, in the padded
layout torch._scaled_grouped_mm's 2d-2d form needs (triton_token_group_cols.token_group_cols_padded). As a
functional op of its own, not hidden inside the wgrad op, two quantizations of the same tensor become two
equal graph nodes that AOTAutograd's CSE merges: an MoE's w1 and w3 read the same permuted tokens x, so
their wgrads share one quantization of x (the largest wgrad operand at DeepSeek-V3 dims, dim 7168).
With row_scale, t is x's FP8 rows saved by quantize_once and the op reads them as their (exact) dequantization:
the BF16 rows are never written, and the kernel reads 1 byte per element instead of 2.
On CUDA the Triton kernel; elsewhere the same layout in plain torch from quant.token_group_cols_padded
(for CPU tests of the graphs that call it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...formats import E4M3
from .. import quant
from ..quant import padded_token_rows


@torch.library.custom_op("moepass::fp8_rowwise_token_group_cols", mutates_args=())
def fp8_rowwise_token_group_cols(t: Tensor, offs: Tensor, row_scale: Optional[Tensor] = None
                                 ) -> tuple[Tensor, Tensor, Tensor]:
    """t [M, D] bf16, offs int32 [E] -> (q [D, P] row-major, scale [E, D], padded group ends int32 [E]).

    Group g holds t[offs[g-1]:offs[g]], starting at padded_ends[g-1], zero-padded to a multiple of 16 rows
    (at least 16). Columns past padded_ends[-1] are not written: no GEMM reads them.
    row_scale: t is e4m3 rows with these fp32 scales [M, 1] (quant.rows'), quantized as quant.dequantize(t, row_scale).
    """
    _check_rows(t, row_scale)
    if t.device.type == "cuda":
        from .triton_token_group_cols import token_group_cols_padded

        return token_group_cols_padded(t, offs, row_scale)
    return quant.token_group_cols_padded(t if row_scale is None else quant.dequantize(t, row_scale), offs)


@fp8_rowwise_token_group_cols.register_fake
def _(t: Tensor, offs: Tensor, row_scale: Optional[Tensor] = None):
    _check_rows(t, row_scale)
    tokens, d = t.shape
    experts = offs.shape[0]
    return (t.new_empty(d, padded_token_rows(tokens, experts), dtype=E4M3),
            t.new_empty(experts, d, dtype=torch.float32), offs.new_empty(experts, dtype=torch.int32))


def _check_rows(t: Tensor, row_scale: Optional[Tensor]) -> None:
    want = torch.bfloat16 if row_scale is None else E4M3
    if t.dtype != want:
        raise ValueError(f"moepass::fp8_rowwise_token_group_cols: t must be {want} "
                         f"{'without' if row_scale is None else 'with'} row_scale; got {t.dtype}")
    if row_scale is not None and (row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (t.shape[0], 1)):
        raise ValueError(f"moepass::fp8_rowwise_token_group_cols: row_scale must be float32 [{t.shape[0]}, 1] (one "
                         f"scale per row of t); got {row_scale.dtype} {tuple(row_scale.shape)}")
