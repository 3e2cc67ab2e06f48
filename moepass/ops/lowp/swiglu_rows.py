"""An expert MLP's SwiGLU fused with the quantization of w2's rows, its inputs kept in FP8 for the backward:
moepass::<recipe>_swiglu_rows, for the recipes whose rows form (grouped_mm_rows.py) supplies a SwiGLURows.

    <recipe>_swiglu_rows(gate[M,K], up[M,K], row_weight[M,1]?, *settings, kernel)
        -> (h[M,K], h_q[M,K] e4m3, h_scale[M,S], gate_q, gate_scale[M,T], up_q, up_scale[M,T])

(h_q, h_scale) is <recipe>_quantize_rows(silu(gate) * up), the product weighted by row_weight when given (the
routing weights weights_before_gemm moved there): w2's operand, as quantize_once hands it to
<recipe>_grouped_mm_rows. h is that GEMM's gradient carrier and holds no data: the GEMM, keeping FP8 rows, never reads
its values. The backward takes grad_h and recomputes silu from gate_q and up_q, which the forward keeps instead of
BF16 gate and up (half the bytes; the recipe says how they are scaled). The op is opaque to Inductor, so the
partitioner cannot keep BF16 gate, up or h instead: a decomposed chain lets it recompute the FP8 copies in the
backward from kept BF16 inputs, which saves nothing (.notes/hopper_speed_plan.md, the CPU experiments).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moepass.recipes.base import Recipe

from ..fresh_outputs import fresh_outputs
from .autocast_off import autocast_off
from .formats import E4M3
from .gemm_args import check_bf16


@dataclasses.dataclass(frozen=True)
class SwiGLURows:
    """What a recipe supplies for its SwiGLU: forward(gate, up, row_weight, *settings, kernel) -> (h_q, h_scale,
    gate_q, gate_scale, up_q, up_scale); backward(grad_h, gate_q, gate_scale, up_q, up_scale, row_weight, dtype) ->
    (grad_gate, grad_up, grad_row_weight); the scale columns of h's rows and of the saved gate and up, from K."""

    forward: Callable
    backward: Callable
    h_scale_columns: Callable[[int], int]
    saved_scale_columns: Callable[[int], int]


def define_swiglu_rows_op(recipe: Recipe, swiglu: SwiGLURows, kernels: tuple[str, ...]):
    """Register moepass::<recipe>_swiglu_rows (real, fake, autograd) and return it."""
    name = recipe.op_name("swiglu_rows")
    settings = list(recipe.op_settings)

    def check(gate, up, row_weight, *args):
        check_bf16(name, gate=gate, up=up)
        if gate.dim() != 2 or tuple(gate.shape) != tuple(up.shape):
            raise ValueError(f"{name}: gate and up must be [M, K] of one shape; got {tuple(gate.shape)} and "
                             f"{tuple(up.shape)}")
        if row_weight is not None and (tuple(row_weight.shape) != (gate.shape[0], 1)
                                       or not row_weight.dtype.is_floating_point):
            raise ValueError(f"{name}: row_weight must be a float [{gate.shape[0]}, 1] column; got "
                             f"{row_weight.dtype} {tuple(row_weight.shape)}")
        if args[-1] not in kernels:
            raise ValueError(f"{name}: kernel {args[-1]!r} is not one of {kernels}")

    params = ", ".join(["Tensor gate", "Tensor up", "Tensor? row_weight", *settings, "str kernel"])

    @torch.library.custom_op(f"moepass::{name}", mutates_args=(), schema=f"({params}) -> ({', '.join(['Tensor'] * 7)})")
    def op(gate, up, row_weight, *args):
        check(gate, up, row_weight, *args)
        carrier = gate.new_empty(gate.shape)  # grad_h's slot: nothing reads its values
        return fresh_outputs((carrier, *autocast_off(swiglu.forward)(gate, up, row_weight, *args)),
                             (gate, up, row_weight))

    @op.register_fake
    def _(gate, up, row_weight, *args):
        check(gate, up, row_weight, *args)
        m, k = gate.shape

        def fp8():
            return gate.new_empty(m, k, dtype=E4M3)

        def scales(columns):
            return gate.new_empty(m, columns, dtype=torch.float32)

        saved = swiglu.saved_scale_columns(k)
        h_scales = scales(swiglu.h_scale_columns(k))
        return gate.new_empty(m, k), fp8(), h_scales, fp8(), scales(saved), fp8(), scales(saved)

    def setup_context(ctx, inputs, output):
        ctx.dtype, ctx.weighted = inputs[0].dtype, inputs[2] is not None
        ctx.save_for_backward(*output[3:], *inputs[2:3] if ctx.weighted else ())  # FP8 gate and up, row_weight

    def backward(ctx, grad_h, *_):
        grads = None, None, None
        if grad_h is not None and any(ctx.needs_input_grad[:3]):
            gate_q, gate_scale, up_q, up_scale, *row_weight = ctx.saved_tensors
            grads = swiglu.backward(grad_h, gate_q, gate_scale, up_q, up_scale, *(row_weight or [None]), ctx.dtype)
        return *grads, *(None,) * (len(settings) + 1)

    op.register_autograd(backward, setup_context=setup_context)
    return op
