"""The toy recipe's grouped GEMMs (moepass::bf16_roundtrip_grouped_mm, _dgrad, _wgrad, which recipe.py registers
through moepass's op family): one plain matmul per token group on the reference kernel."""

from __future__ import annotations

from torch import Tensor

from moepass.ops.lowp.grouped_wgrad_bf16 import as_transposed_layout
from moepass.ops.lowp.op_recipe import RecipeGemms

from .kernels import reference
from .kernels.choice import check_settings


def _groups(offs: Tensor) -> list[slice]:
    ends = offs.tolist()
    return [slice(begin, end) for begin, end in zip([0, *ends[:-1]], ends)]


def forward(x: Tensor, w_t: Tensor, offs: Tensor, accumulate: str, kernel: str) -> Tensor:
    """out[g] = x[g] @ w_t[g]; rows at or after offs[-1] belong to no group and stay zero."""
    reference.CALLS.append(("grouped_mm", accumulate, kernel))
    out = x.new_zeros(x.shape[0], w_t.shape[2])
    for e, rows in enumerate(_groups(offs)):
        out[rows] = reference.mm(x[rows], w_t[e], accumulate)
    return out


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, accumulate: str, kernel: str) -> Tensor:
    reference.CALLS.append(("grouped_mm_dgrad", accumulate, kernel))
    grad_x = grad_out.new_zeros(grad_out.shape[0], w_t.shape[1])
    for e, rows in enumerate(_groups(offs)):
        grad_x[rows] = reference.mm(grad_out[rows], w_t[e].t(), accumulate)
    return grad_x


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, accumulate: str, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g], in w_t's (transposed) layout."""
    reference.CALLS.append(("grouped_mm_wgrad", accumulate, kernel))
    grad_w_t = x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1])
    for e, rows in enumerate(_groups(offs)):
        grad_w_t[e] = reference.mm(x[rows].t(), grad_out[rows], accumulate)
    return as_transposed_layout(grad_w_t)


GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)  # registered as ops by recipe.py
