"""The grouped GEMM op family, one per recipe: moepass::<recipe>_grouped_mm (semantics of
torch._grouped_mm(x, w_t, offs=offs)) and its two backward GEMMs as separate ops.

x [M, K] @ w_t[g] [K, N] per token group g (offs: int32 cumulative group ends); dgrad: grad_x = grad_out @
w_t[g].T per group; wgrad: grad_w_t[g] = x[g].T @ grad_out[g]. The recipe's ops module supplies the three GEMMs
(op_recipe.RecipeGemms); this module gives every recipe the same schemas, argument checks, fake implementations and
autograd (the wgrad in BF16, moepass::grouped_mm_wgrad_bf16, under wgrad_bf16).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moepass.op_registry import register_gemm
from moepass.recipes.base import Recipe

from .autocast_off import autocast_off
from .gemm_args import check_bf16, check_offs, check_weight
from .grouped_wgrad_bf16 import as_transposed_layout
from .op_recipe import RecipeGemms, check_dims, define_op, split_forward_args
from .sharding import register_gemm_sharding

GEMMS = {"grouped_mm": "forward", "grouped_mm_dgrad": "dgrad", "grouped_mm_wgrad": "wgrad"}  # op -> which of the three


def check_grouped(recipe: Recipe, gemms: RecipeGemms, op: str, name: str, tokens: Tensor, w_t: Tensor,
                  offs: Tensor, args: tuple) -> None:
    """tokens [M, K] (forward, name "x") or [M, N] (dgrad, name "grad_out") against w_t [E, K, N], offs int32 [E]."""
    check_bf16(op, **{name: tokens})
    check_weight(op, w_t=w_t)
    gemms.check_settings(tokens.device, True, *args)
    if tokens.dim() != 2 or w_t.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"{op}: expected {name} [M, D], w_t [E, K, N] and offs [E], got {tuple(tokens.shape)}, "
                         f"{tuple(w_t.shape)}, {tuple(offs.shape)}")
    check_offs(op, offs, w_t.shape[0])
    dim = 1 if name == "x" else 2
    if tokens.shape[1] != w_t.shape[dim]:
        raise ValueError(f"{op}: {name} {tuple(tokens.shape)} does not match w_t {tuple(w_t.shape)} "
                         f"along {'K' if dim == 1 else 'N'}")
    check_dims(recipe, op, K=w_t.shape[1], N=w_t.shape[2])


def check_wgrad(recipe: Recipe, gemms: RecipeGemms, grad_out: Tensor, x: Tensor, offs: Tensor,
                args: tuple) -> None:
    op = recipe.op_name("grouped_mm_wgrad")
    check_bf16(op, grad_out=grad_out, x=x)
    gemms.check_settings(x.device, True, *args)
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must be 2-D with the same tokens")
    check_offs(op, offs)
    check_dims(recipe, op, K=x.shape[1], N=grad_out.shape[1])


def define_grouped_mm_ops(recipe: Recipe, gemms: RecipeGemms) -> None:
    """Register moepass::<recipe>_grouped_mm, _grouped_mm_dgrad and _grouped_mm_wgrad with fakes, autograd, DTensor
    strategies, and their roles in moepass.op_registry."""
    settings = list(recipe.op_settings)
    fwd_name, dgrad_name = recipe.op_name("grouped_mm"), recipe.op_name("grouped_mm_dgrad")

    def gemm_args(args: tuple) -> tuple:  # the forward's (*settings, wgrad_bf16, kernel) -> (*settings, kernel)
        return split_forward_args(args)[0]

    op = define_op(fwd_name, ["Tensor x", "Tensor w_t", "Tensor offs", *settings, "bool wgrad_bf16", "str kernel"],
                   check=lambda x, w_t, offs, *args: check_grouped(recipe, gemms, fwd_name, "x", x, w_t, offs,
                                                                   gemm_args(args)),
                   compute=autocast_off(lambda x, w_t, offs, *args: gemms.forward(x, w_t, offs, *gemm_args(args))),
                   output=lambda x, w_t, offs, *args: x.new_empty(x.shape[0], w_t.shape[2]))
    define_op(dgrad_name, ["Tensor grad_out", "Tensor w_t", "Tensor offs", *settings, "str kernel"],
              check=lambda g, w_t, offs, *args: check_grouped(recipe, gemms, dgrad_name, "grad_out", g, w_t, offs,
                                                                args),
              compute=autocast_off(gemms.dgrad),
              output=lambda g, w_t, offs, *args: g.new_empty(g.shape[0], w_t.shape[1]))
    define_op(recipe.op_name("grouped_mm_wgrad"),
              ["Tensor grad_out", "Tensor x", "Tensor offs", *settings, "str kernel"],
              check=lambda g, x, offs, *args: check_wgrad(recipe, gemms, g, x, offs, args),
              compute=autocast_off(gemms.wgrad),
              output=lambda g, x, offs, *args: as_transposed_layout(x.new_empty(offs.shape[0], x.shape[1],
                                                                                g.shape[1])))
    op.register_autograd(_backward_of(recipe), setup_context=_setup_context)
    for gemm, role in GEMMS.items():  # expert TP: DTensor runs them on shards
        register_gemm_sharding(recipe.op(gemm).default, gemm, recipe.multiple)
        register_gemm(recipe.op(gemm), "grouped", role)


def _setup_context(ctx, inputs, output):
    x, w_t, offs, *args = inputs
    ctx.save_for_backward(x, w_t, offs)
    ctx.gemm_args, ctx.wgrad_bf16 = split_forward_args(tuple(args))


def weight_grad(grad_w_t: Tensor, w_t: Tensor) -> Tensor:
    """The weight's gradient in the weight's dtype: an FP32 weight gets it in FP32, as autocast's cast gives it (the
    layout kept: w_t's)."""
    return grad_w_t if grad_w_t.dtype == w_t.dtype else grad_w_t.to(w_t.dtype)


def _backward_of(recipe: Recipe):
    def backward(ctx, grad_out):
        x, w_t, offs = ctx.saved_tensors
        grad_x = grad_w_t = None
        if ctx.needs_input_grad[0]:
            grad_x = recipe.op("grouped_mm_dgrad")(grad_out, w_t, offs, *ctx.gemm_args)
        if ctx.needs_input_grad[1]:
            if ctx.wgrad_bf16:
                grad_w_t = torch.ops.moepass.grouped_mm_wgrad_bf16(grad_out, x, offs)
            else:
                grad_w_t = recipe.op("grouped_mm_wgrad")(grad_out, x, offs, *ctx.gemm_args)
            grad_w_t = weight_grad(grad_w_t, w_t)
        return grad_x, grad_w_t, None, *(None,) * (len(ctx.gemm_args) + 1)  # offs, settings, wgrad_bf16, kernel

    return backward
