"""The FP8 GEMM primitives: torch._scaled_mm / torch._scaled_grouped_mm with rowwise scales, and their settings.

A leaf: the FP8-rowwise ops, their plain-torch decomposition (decomp) and the benchmarks all
import these, and it imports none of them. Scales passed in are multipliers (q = t * scale); the GEMMs
take their reciprocals, torch._scaled_mm's dequantization convention.
"""

from __future__ import annotations

import torch
from torch import Tensor

BF16 = torch.bfloat16

# torchao Float8Linear's rowwise defaults: fast accumulation only where the reduction is over K of the
# forward; the gradients reduce over N or over all tokens and keep CUTLASS's fp32 promotion.
LINEAR_FAST_ACCUM = {"fwd": True, "dgrad": False, "wgrad": False}
GROUPED_FAST_ACCUM = True  # torchao's _Float8GroupedMM runs all three grouped GEMMs with fast accumulation


def scaled_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, gemm: str) -> Tensor:
    """a [M, K] row-major (scale [M, 1]) @ b [K, N] column-major (scale [1, N]) -> bf16; gemm: fwd/dgrad/wgrad."""
    return torch._scaled_mm(a_q, b_q, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(),
                            out_dtype=BF16, use_fast_accum=LINEAR_FAST_ACCUM[gemm])


def scaled_grouped_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, offs: Tensor) -> Tensor:
    """torch._scaled_grouped_mm with our multipliers turned into its dequantization scales."""
    return torch._scaled_grouped_mm(a_q, b_q, a_scale.reciprocal(), b_scale.reciprocal(), offs,
                                    out_dtype=BF16, use_fast_accum=GROUPED_FAST_ACCUM)


def zero_rows_after_last_group(out: Tensor, offs: Tensor) -> Tensor:
    """Rows at or after offs[-1] (which the grouped GEMM leaves unwritten) set to zero by a pointwise select
    (Inductor fuses it into the consumer)."""
    rows = torch.arange(out.shape[0], device=out.device).unsqueeze(-1)
    return torch.where(rows < offs[-1:], out, out.new_zeros(()))
