"""moepass::mxfp8_grouped_mm (semantics of torch._grouped_mm(x, w_t, offs=offs)) and its backward GEMMs.

Built on torchao's _compute_fwd / _compute_dgrad / _compute_wgrad, on token groups padded to
multiples of 32 rows (mxfp8_token_groups); padding never reaches outputs or gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gemm_args import check_bf16, check_offs
from .grouped_wgrad_bf16 import as_transposed_layout
from .mxfp8_args import BLOCK_SIZE, check_block_multiple, check_strings, scale_mode
from .mxfp8_kernels import kernel_preference
from .mxfp8_token_groups import pad_token_groups, plan_token_group_padding, unpad_token_groups


def _check_grouped(op: str, name: str, tokens: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str,
                   kernel: str) -> None:
    """tokens [M, K] (forward, name "x") or [M, N] (dgrad, name "grad_out") against w_t [E, K, N], offs int32 [E]."""
    check_bf16(op, **{name: tokens}, w_t=w_t)
    check_strings(scale_rounding, kernel, tokens.device)
    if tokens.dim() != 2 or w_t.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"{op}: expected {name} [M, D], w_t [E, K, N] and offs [E], got {tuple(tokens.shape)}, "
                         f"{tuple(w_t.shape)}, {tuple(offs.shape)}")
    check_offs(op, offs, w_t.shape[0])
    dim = 1 if name == "x" else 2
    if tokens.shape[1] != w_t.shape[dim]:
        raise ValueError(f"{op}: {name} {tuple(tokens.shape)} does not match w_t {tuple(w_t.shape)} "
                         f"along {'K' if dim == 1 else 'N'}")
    check_block_multiple(op, K=w_t.shape[1], N=w_t.shape[2])


# ---- forward ---------------------------------------------------------------------------------------

@torch.library.custom_op("moepass::mxfp8_grouped_mm", mutates_args=())
def mxfp8_grouped_mm(x: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, wgrad_bf16: bool,
                     kernel: str) -> Tensor:
    _check_grouped("mxfp8_grouped_mm", "x", x, w_t, offs, scale_rounding, kernel)
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_fwd

    plan = plan_token_group_padding(offs, x.shape[0])
    out = _compute_fwd(pad_token_groups(x, plan), as_transposed_layout(w_t), plan.padded_offs, BLOCK_SIZE,
                       torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(out, plan)


@mxfp8_grouped_mm.register_fake
def _(x, w_t, offs, scale_rounding, wgrad_bf16, kernel):
    _check_grouped("mxfp8_grouped_mm", "x", x, w_t, offs, scale_rounding, kernel)
    return x.new_empty(x.shape[0], w_t.shape[2])


# ---- dgrad: grad_x = grad_out @ w_t[g].T per group, scaled along N ----------------------------------

@torch.library.custom_op("moepass::mxfp8_grouped_mm_dgrad", mutates_args=())
def mxfp8_grouped_mm_dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    _check_grouped("mxfp8_grouped_mm_dgrad", "grad_out", grad_out, w_t, offs, scale_rounding, kernel)
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_dgrad

    plan = plan_token_group_padding(offs, grad_out.shape[0])
    grad_x = _compute_dgrad(pad_token_groups(grad_out, plan), as_transposed_layout(w_t), plan.padded_offs,
                            BLOCK_SIZE, torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(grad_x, plan)


@mxfp8_grouped_mm_dgrad.register_fake
def _(grad_out, w_t, offs, scale_rounding, kernel):
    _check_grouped("mxfp8_grouped_mm_dgrad", "grad_out", grad_out, w_t, offs, scale_rounding, kernel)
    return grad_out.new_empty(grad_out.shape[0], w_t.shape[1])


# ---- wgrad: grad_w_t[g] = x[g].T @ grad_out[g], scaled along tokens ---------------------------------

def _check_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> None:
    check_bf16("mxfp8_grouped_mm_wgrad", grad_out=grad_out, x=x)
    check_strings(scale_rounding, kernel, x.device)
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"mxfp8_grouped_mm_wgrad: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must be 2-D with the same tokens")
    check_offs("mxfp8_grouped_mm_wgrad", offs)
    check_block_multiple("mxfp8_grouped_mm_wgrad", K=x.shape[1], N=grad_out.shape[1])


@torch.library.custom_op("moepass::mxfp8_grouped_mm_wgrad", mutates_args=())
def mxfp8_grouped_mm_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    _check_wgrad(grad_out, x, offs, scale_rounding, kernel)
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_wgrad

    plan = plan_token_group_padding(offs, x.shape[0])
    grad_w_t = _compute_wgrad(pad_token_groups(grad_out, plan), pad_token_groups(x, plan), plan.padded_offs,
                              BLOCK_SIZE, torch.bfloat16, scale_mode(scale_rounding), False, kernel_preference(kernel))
    return as_transposed_layout(grad_w_t)


@mxfp8_grouped_mm_wgrad.register_fake
def _(grad_out, x, offs, scale_rounding, kernel):
    _check_wgrad(grad_out, x, offs, scale_rounding, kernel)
    return as_transposed_layout(x.new_empty(offs.shape[0], x.shape[1], grad_out.shape[1]))


# ---- autograd ----------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    x, w_t, offs, scale_rounding, wgrad_bf16, kernel = inputs
    ctx.save_for_backward(x, w_t, offs)
    ctx.scale_rounding, ctx.wgrad_bf16, ctx.kernel = scale_rounding, wgrad_bf16, kernel


def _backward(ctx, grad_out):
    x, w_t, offs = ctx.saved_tensors
    grad_x = grad_w_t = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.moepass.mxfp8_grouped_mm_dgrad(grad_out, w_t, offs, ctx.scale_rounding, ctx.kernel)
    if ctx.needs_input_grad[1]:
        if ctx.wgrad_bf16:
            grad_w_t = torch.ops.moepass.grouped_mm_wgrad_bf16(grad_out, x, offs)
        else:
            grad_w_t = torch.ops.moepass.mxfp8_grouped_mm_wgrad(grad_out, x, offs, ctx.scale_rounding, ctx.kernel)
    return grad_x, grad_w_t, None, None, None, None


mxfp8_grouped_mm.register_autograd(_backward, setup_context=_setup_context)
