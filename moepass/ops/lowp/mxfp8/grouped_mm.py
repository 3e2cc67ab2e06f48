"""MXFP8 grouped GEMMs (moepass::mxfp8_grouped_mm, _dgrad, _wgrad, which recipe.py registers through the op family
lowp/grouped_mm.py).

Built on torchao's _compute_fwd / _compute_dgrad / _compute_wgrad, on token groups padded to multiples of 32 rows
(ops/lowp/token_group_padding.py); padding never reaches outputs or gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moepass.torchao_import import torchao_import

from ..grouped_wgrad_bf16 import as_transposed_layout
from ..op_recipe import RecipeGemms
from ..token_group_padding import pad_token_groups, plan_token_group_padding, unpad_token_groups
from .kernels.choice import check_settings, kernel_preference, scale_mode
from .quant import BLOCK, kernel_weight


def forward(x: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """out = x[g] @ w_t[g] per token group, both scaled along K."""
    with torchao_import():
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_fwd

    plan = plan_token_group_padding(offs, x.shape[0], BLOCK)
    w_t = w_t if kernel == "emulated" else kernel_weight(w_t)
    out = _compute_fwd(pad_token_groups(x, plan), as_transposed_layout(w_t), plan.padded_offs, BLOCK,
                       torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(out, plan)


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_x = grad_out @ w_t[g].T per group, scaled along N."""
    with torchao_import():
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_dgrad

    plan = plan_token_group_padding(offs, grad_out.shape[0], BLOCK)
    w_t = w_t if kernel == "emulated" else kernel_weight(w_t)
    grad_x = _compute_dgrad(pad_token_groups(grad_out, plan), as_transposed_layout(w_t), plan.padded_offs,
                            BLOCK, torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(grad_x, plan)


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g], scaled along tokens."""
    with torchao_import():
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_wgrad

    plan = plan_token_group_padding(offs, x.shape[0], BLOCK)
    grad_w_t = _compute_wgrad(pad_token_groups(grad_out, plan), pad_token_groups(x, plan), plan.padded_offs,
                              BLOCK, torch.bfloat16, scale_mode(scale_rounding), False, kernel_preference(kernel))
    return as_transposed_layout(grad_w_t)


GEMMS = RecipeGemms(forward, dgrad, wgrad, check_settings)  # registered as ops by recipe.py
