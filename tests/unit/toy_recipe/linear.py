"""The toy recipe's linear GEMMs (moepass::bf16_roundtrip_linear, _dgrad, _wgrad, which recipe.py registers through
moepass's op family): plain matmuls on the reference kernel."""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from moepass.ops.lowp.op_recipe import RecipeGemms

from .kernels import reference
from .kernels.choice import check_settings


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], accumulate: str, kernel: str) -> Tensor:
    reference.CALLS.append(("linear", accumulate, kernel))
    y = reference.mm(x.reshape(-1, x.shape[-1]), weight.t(), accumulate)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dgrad(grad_out: Tensor, weight: Tensor, accumulate: str, kernel: str) -> Tensor:
    reference.CALLS.append(("linear_dgrad", accumulate, kernel))
    grad_x = reference.mm(grad_out.reshape(-1, grad_out.shape[-1]), weight, accumulate)
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def wgrad(grad_out: Tensor, x: Tensor, accumulate: str, kernel: str) -> Tensor:
    reference.CALLS.append(("linear_wgrad", accumulate, kernel))
    return reference.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]), accumulate)


GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)  # registered as ops by recipe.py
