"""The linear op family, one per recipe: moepass::<recipe>_linear and its two backward GEMMs as separate ops.

y = x @ W.T (+ b); dgrad: grad_x = grad_out @ W (operands scaled along N); wgrad: grad_W = grad_out.T @ x
(operands scaled along tokens). The recipe's ops module supplies the three GEMMs (op_recipe.RecipeGemms); this
module gives every recipe the same schemas, argument checks (fake and real impls both run them, so a bad call
fails at compile time), fake implementations and autograd, whose backward calls the dgrad / wgrad ops so
AOTAutograd's backward graph shows them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moepass.op_registry import register_gemm
from moepass.recipes.base import Recipe

from .autocast_off import autocast_off
from .gemm_args import check_bf16, check_weight
from .op_recipe import RecipeGemms, check_dims, define_op, split_forward_args
from .sharding import register_gemm_sharding

GEMMS = {"linear": "forward", "linear_dgrad": "dgrad", "linear_wgrad": "wgrad"}  # op -> which of the three


def _check_operands(gemms: RecipeGemms, op: str, name: str, t: Tensor, weight: Tensor, args: tuple) -> None:
    check_bf16(op, **{name: t})
    check_weight(op, weight=weight)
    gemms.check_settings(t.device, False, *args)
    if weight.dim() != 2 or t.dim() < 1:
        raise ValueError(f"{op}: weight must be [N, K] and {name} [..., D], "
                         f"got {name} {tuple(t.shape)}, weight {tuple(weight.shape)}")


def check_forward(recipe: Recipe, gemms: RecipeGemms, x: Tensor, weight: Tensor, bias: Optional[Tensor],
                  args: tuple) -> None:
    op = recipe.op_name("linear")
    _check_operands(gemms, op, "x", x, weight, args)
    check_bf16(op, bias=bias)
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"{op}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not form x @ weight.T + bias")
    check_dims(recipe, op, K=k, N=n)  # N: dgrad contracts over it


def check_dgrad(recipe: Recipe, gemms: RecipeGemms, grad_out: Tensor, weight: Tensor, args: tuple) -> None:
    op = recipe.op_name("linear_dgrad")
    _check_operands(gemms, op, "grad_out", grad_out, weight, args)
    n, k = weight.shape
    if grad_out.shape[-1] != n:
        raise ValueError(f"{op}: grad_out {tuple(grad_out.shape)} does not match weight {tuple(weight.shape)}")
    check_dims(recipe, op, K=k, N=n)


def check_wgrad(recipe: Recipe, gemms: RecipeGemms, grad_out: Tensor, x: Tensor, args: tuple) -> None:
    op = recipe.op_name("linear_wgrad")
    check_bf16(op, grad_out=grad_out, x=x)
    gemms.check_settings(x.device, False, *args)
    if grad_out.dim() < 1 or grad_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"{op}: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must share leading (token) dims")
    check_dims(recipe, op, K=x.shape[-1], N=grad_out.shape[-1])


def define_linear_ops(recipe: Recipe, gemms: RecipeGemms) -> None:
    """Register moepass::<recipe>_linear, _linear_dgrad and _linear_wgrad with fakes, autograd, DTensor strategies,
    and their roles in moepass.op_registry."""
    settings = list(recipe.op_settings)

    def gemm_args(args: tuple) -> tuple:  # the forward's (*settings, wgrad_bf16, kernel) -> (*settings, kernel)
        return split_forward_args(args)[0]

    op = define_op(recipe.op_name("linear"),
                   ["Tensor x", "Tensor weight", "Tensor? bias", *settings, "bool wgrad_bf16", "str kernel"],
                   check=lambda x, w, b, *args: check_forward(recipe, gemms, x, w, b, gemm_args(args)),
                   compute=autocast_off(lambda x, w, b, *args: gemms.forward(x, w, b, *gemm_args(args))),
                   output=lambda x, w, b, *args: x.new_empty(*x.shape[:-1], w.shape[0]))
    define_op(recipe.op_name("linear_dgrad"), ["Tensor grad_out", "Tensor weight", *settings, "str kernel"],
              check=lambda g, w, *args: check_dgrad(recipe, gemms, g, w, args), compute=autocast_off(gemms.dgrad),
              output=lambda g, w, *args: g.new_empty(*g.shape[:-1], w.shape[1]))
    define_op(recipe.op_name("linear_wgrad"), ["Tensor grad_out", "Tensor x", *settings, "str kernel"],
              check=lambda g, x, *args: check_wgrad(recipe, gemms, g, x, args), compute=autocast_off(gemms.wgrad),
              output=lambda g, x, *args: x.new_empty(g.shape[-1], x.shape[-1]))
    op.register_autograd(_backward_of(recipe), setup_context=_setup_context)
    for gemm, role in GEMMS.items():  # tensor parallelism: DTensor runs them on shards
        register_gemm_sharding(recipe.op(gemm).default, gemm, recipe.multiple)
        register_gemm(recipe.op(gemm), "linear", role)


def _setup_context(ctx, inputs, output):
    x, weight, bias, *args = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.weight_dtype = weight.dtype
    ctx.gemm_args, ctx.wgrad_bf16 = split_forward_args(tuple(args))


def _backward_of(recipe: Recipe):
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = recipe.op("linear_dgrad")(grad_out, weight, *ctx.gemm_args)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad_bf16:
                grad_w = torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
            else:
                grad_w = recipe.op("linear_wgrad")(grad_out, x, *ctx.gemm_args)
            if grad_w.dtype != ctx.weight_dtype:  # an FP32 weight gets its gradient in FP32, as autocast's cast gives
                grad_w = grad_w.to(ctx.weight_dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            # Sum over tokens with an fp32 accumulator, rounded once to the bias dtype.
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, *(None,) * (len(ctx.gemm_args) + 1)  # settings, wgrad_bf16, kernel

    return backward
