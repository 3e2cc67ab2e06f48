"""MXFP8 grouped GEMMs (moepass::mxfp8_grouped_mm, _dgrad, _wgrad; the op family is grouped_mm.py).

Built on torchao's _compute_fwd / _compute_dgrad / _compute_wgrad, on token groups padded to
multiples of 32 rows (mxfp8_token_groups); padding never reaches outputs or gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .formats import MX_BLOCK
from .grouped_mm import define_grouped_mm_ops
from .grouped_wgrad_bf16 import as_transposed_layout
from .mxfp8_kernels import kernel_preference
from .mxfp8_recipe import MXFP8, scale_mode
from .mxfp8_token_groups import pad_token_groups, plan_token_group_padding, unpad_token_groups
from .op_recipe import RecipeGemms


def forward(x: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_fwd

    plan = plan_token_group_padding(offs, x.shape[0])
    out = _compute_fwd(pad_token_groups(x, plan), as_transposed_layout(w_t), plan.padded_offs, MX_BLOCK,
                       torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(out, plan)


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_x = grad_out @ w_t[g].T per group, scaled along N."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_dgrad

    plan = plan_token_group_padding(offs, grad_out.shape[0])
    grad_x = _compute_dgrad(pad_token_groups(grad_out, plan), as_transposed_layout(w_t), plan.padded_offs,
                            MX_BLOCK, torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(grad_x, plan)


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g], scaled along tokens."""
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_wgrad

    plan = plan_token_group_padding(offs, x.shape[0])
    grad_w_t = _compute_wgrad(pad_token_groups(grad_out, plan), pad_token_groups(x, plan), plan.padded_offs,
                              MX_BLOCK, torch.bfloat16, scale_mode(scale_rounding), False, kernel_preference(kernel))
    return as_transposed_layout(grad_w_t)


define_grouped_mm_ops(MXFP8, RecipeGemms(forward, dgrad, wgrad))
