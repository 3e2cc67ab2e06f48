"""Expert GEMMs on rows quantized before their gather (or EP dispatch): moepass::<recipe>_quantize_rows and
moepass::<recipe>_grouped_mm_rows, for the recipes whose grouped forward scales x per row along K (fp8_rowwise: one
scale per row; blockwise: one per 1x128 tile).

An expert's input rows are a gather of token rows, and per-row quantization commutes with a gather of rows:
quantizing the T token rows once, then gathering FP8 rows and their scales, gives the bits quantize-after-gather
gives, while it quantizes T rows instead of T * top_k (once for w1 and w3 alike) and moves half the bytes.

    <recipe>_quantize_rows(x[T,K], *settings, kernel) -> q[T,K] e4m3, scale[T,S] fp32   (the forward's x quantization)
    <recipe>_grouped_mm_rows(x[M,K], x_q[M,K], x_scale[M,S], w_t[E,K,N], offs[E], saved_fp8, *settings,
                             wgrad_bf16, kernel) -> [M,N]: <recipe>_grouped_mm(x, w_t, offs, ...) from (x_q, x_scale)

The contract is that (x_q, x_scale) is the recipe's quantization of x's rows; x carries the rows' gradient (grad_x
= the dgrad, as for <recipe>_grouped_mm). The forward and dgrad are bit-equal to the recipe's grouped op on x.
What the backward keeps for the wgrad:
- saved_fp8: x_q and x_scale, not BF16 rows (FP8 activations: half the bytes, rows shared by w1 and w3 once), and
  x's values are never read; the wgrad reads their dequantization, exact in BF16 for fp8_rowwise's power-of-two
  scales, rounded to BF16 for blockwise's (DeepSeek-V3 keeps its experts' inputs in FP8 the same way). A BF16 wgrad
  then sees the quantized rows, not the BF16 ones. A recipe whose RowGemms has a wgrad (fp8_rowwise) runs its FP8
  wgrad as moepass::<recipe>_grouped_mm_wgrad_on_rows(grad_out, x_q, x_scale, offs, ...), which reads the FP8 rows
  without writing their dequantization first.
- not saved_fp8: x itself, as <recipe>_grouped_mm does, so the wgrad is that op's, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from moepass.op_registry import register_gemm, register_rows_form
from moepass.recipes.base import Recipe

from ..fresh_outputs import fresh_outputs
from .formats import E4M3
from .gemm_args import check_bf16
from .autocast_off import autocast_off
from .grouped_mm import check_grouped, check_wgrad, weight_grad
from .grouped_wgrad_bf16 import as_transposed_layout
from .swiglu_rows import SwiGLURows, define_swiglu_rows_op
from .op_recipe import RecipeGemms, check_dims, define_op, split_forward_args


@dataclasses.dataclass(frozen=True)
class RowGemms:
    """What a recipe supplies for its rows form, each called as f(*tensors, *settings, kernel) except dequantize."""

    quantize: Callable  # x [T, K] -> (q [T, K] e4m3, scale [T, scale_columns(K)] fp32): the forward's quantization
    forward: Callable  # (q, scale, w_t, offs) -> [M, N]: the grouped forward GEMM on quantized rows
    dequantize: Callable  # (q, scale) -> bf16 [M, K]
    scale_columns: Callable[[int], int]  # K -> S
    kernels: tuple[str, ...]  # the recipe's kernels that have this form
    # Whether the FP8 wgrad may re-quantize the dequantized rows along tokens. With power-of-two scales the re-tiled
    # values are the BF16 rows' own (fp8_rowwise); with blockwise's amax / 448 scales a second rounding adds error
    # (docs/options.md, quantize_once.saved_rows), so there the wgrad is BF16 on the dequantized rows,
    # whose error matches that FP8 wgrad (DeepSeek-V3 rounds these activations' scales to powers of two instead).
    fp8_wgrad_on_rows: bool
    # (grad_out, q, scale, offs, *settings, kernel) -> grad_w_t: that FP8 wgrad reading the saved rows in FP8, equal
    # to the recipe's wgrad on dequantize(q, scale) (moepass::<recipe>_grouped_mm_wgrad_on_rows); None: that wgrad
    wgrad: Callable | None = None
    # the SwiGLU making w2's rows, fused with their quantization and keeping its inputs in FP8 (swiglu_rows.py)
    swiglu: SwiGLURows | None = None


def _check_quantized(op: str, rows: RowGemms, q: Tensor, scale: Tensor, like: Tensor) -> None:
    m, k = like.shape
    if q.dtype != E4M3 or tuple(q.shape) != (m, k):
        raise ValueError(f"{op}: x_q must be {E4M3} [{m}, {k}] like x; got {q.dtype} {tuple(q.shape)}")
    s = rows.scale_columns(k)
    if scale.dtype != torch.float32 or tuple(scale.shape) != (m, s):
        raise ValueError(f"{op}: x_scale must be float32 [{m}, {s}] (the recipe's scales of x's rows); got "
                         f"{scale.dtype} {tuple(scale.shape)}")


def define_grouped_mm_rows_ops(recipe: Recipe, gemms: RecipeGemms, rows: RowGemms) -> None:
    """Register moepass::<recipe>_quantize_rows and <recipe>_grouped_mm_rows (fake, autograd, GEMM role) and record
    them as the rows form of <recipe>_grouped_mm (moepass.op_registry.rows_form)."""
    settings = list(recipe.op_settings)
    quantize_name, name = recipe.op_name("quantize_rows"), recipe.op_name("grouped_mm_rows")

    def check_quantize(x, *args):
        if args[-1] not in rows.kernels:
            raise ValueError(f"{quantize_name}: kernel {args[-1]!r} has no rows form (only {rows.kernels})")
        check_bf16(quantize_name, x=x)
        gemms.check_settings(x.device, True, *args)
        if x.dim() != 2:
            raise ValueError(f"{quantize_name}: expected x [T, K], got {tuple(x.shape)}")
        check_dims(recipe, quantize_name, K=x.shape[1])

    @torch.library.custom_op(f"moepass::{quantize_name}", mutates_args=(),
                             schema=f"(Tensor x, {', '.join([*settings, 'str kernel'])}) -> (Tensor, Tensor)")
    def quantize(x, *args):
        check_quantize(x, *args)
        return fresh_outputs(autocast_off(rows.quantize)(x, *args), (x,))  # blockwise's q: a view of its tiles

    @quantize.register_fake
    def _(x, *args):
        check_quantize(x, *args)
        return (x.new_empty(x.shape, dtype=E4M3),
                x.new_empty((x.shape[0], rows.scale_columns(x.shape[1])), dtype=torch.float32))

    def check(x, x_q, x_scale, w_t, offs, _saved_fp8, *args):
        gemm_args = split_forward_args(args)[0]
        check_grouped(recipe, gemms, name, "x", x, w_t, offs, gemm_args)
        _check_quantized(name, rows, x_q, x_scale, x)

    op = define_op(name, ["Tensor x", "Tensor x_q", "Tensor x_scale", "Tensor w_t", "Tensor offs", "bool saved_fp8",
                          *settings, "bool wgrad_bf16", "str kernel"],
                   check=check,
                   compute=autocast_off(lambda x, x_q, x_scale, w_t, offs, _, *args: rows.forward(
                       x_q, x_scale, w_t, offs, *split_forward_args(args)[0])),
                   output=lambda x, x_q, x_scale, w_t, offs, *args: x.new_empty(x.shape[0], w_t.shape[2]))
    op.register_autograd(_backward_of(recipe, rows), setup_context=_setup_context)

    # The same GEMM without x, no autograd: what grouped_mm_rows decomposes into below autograd
    # (rows_decompositions), so x (a BF16 gather, or under EP a carrier) is dead in compiled forward graphs.
    def check_gemm(x_q, x_scale, w_t, offs, *gemm_args):
        # x's shape, dtype and device for the shared checks, without allocating rows on every call
        like = torch.empty((), dtype=torch.bfloat16, device=x_q.device).expand(x_q.shape)
        check_grouped(recipe, gemms, gemm_name, "x", like, w_t, offs, gemm_args)
        _check_quantized(gemm_name, rows, x_q, x_scale, like)

    gemm_name = recipe.op_name("grouped_mm_on_rows")
    define_op(gemm_name, ["Tensor x_q", "Tensor x_scale", "Tensor w_t", "Tensor offs", *settings, "str kernel"],
              check=check_gemm, compute=autocast_off(rows.forward),
              output=lambda x_q, x_scale, w_t, offs, *args: x_q.new_empty(x_q.shape[0], w_t.shape[2],
                                                                          dtype=torch.bfloat16))
    for gemm_op in (op, recipe.op("grouped_mm_on_rows")):
        register_gemm(gemm_op, "grouped", "forward")
    if rows.wgrad is not None:
        _define_wgrad_on_rows(recipe, gemms, rows)
    if rows.swiglu is not None:
        define_swiglu_rows_op(recipe, rows.swiglu, rows.kernels)
    swiglu = recipe.op("swiglu_rows") if rows.swiglu is not None else None
    register_rows_form(recipe.op("grouped_mm"), recipe.op("quantize_rows"), recipe.op("grouped_mm_rows"),
                       recipe.op("grouped_mm_on_rows"), rows.kernels, rows.fp8_wgrad_on_rows, swiglu)


def _define_wgrad_on_rows(recipe: Recipe, gemms: RecipeGemms, rows: RowGemms) -> None:
    """moepass::<recipe>_grouped_mm_wgrad_on_rows(grad_out, x_q, x_scale, offs, *settings, kernel): the FP8 wgrad on
    saved FP8 rows, without their BF16 dequantization in between (a write and a read of 2 bytes per element)."""
    name = recipe.op_name("grouped_mm_wgrad_on_rows")

    def check(grad_out, x_q, x_scale, offs, *args):
        like = torch.empty((), dtype=torch.bfloat16, device=x_q.device).expand(x_q.shape)
        check_wgrad(recipe, gemms, grad_out, like, offs, args)
        _check_quantized(name, rows, x_q, x_scale, like)

    define_op(name, ["Tensor grad_out", "Tensor x_q", "Tensor x_scale", "Tensor offs", *recipe.op_settings,
                     "str kernel"],
              check=check, compute=autocast_off(rows.wgrad),
              output=lambda g, x_q, x_scale, offs, *args: as_transposed_layout(
                  g.new_empty(offs.shape[0], x_q.shape[1], g.shape[1])))
    register_gemm(recipe.op("grouped_mm_wgrad_on_rows"), "grouped", "wgrad")


def rows_decompositions(recipe: Recipe) -> dict:
    """{<recipe>_grouped_mm_rows: the GEMM on (x_q, x_scale) alone}, for the backend's Inductor table: applied below
    autograd, it leaves x unread, so Inductor drops the BF16 rows it would otherwise gather or keep."""
    gemm = recipe.op("grouped_mm_on_rows").default

    def decompose(x, x_q, x_scale, w_t, offs, _saved_fp8, *args):
        return gemm(x_q, x_scale, w_t, offs, *split_forward_args(args)[0])

    return {recipe.op("grouped_mm_rows").default: decompose}


def _setup_context(ctx, inputs, output):
    x, x_q, x_scale, w_t, offs, saved_fp8, *args = inputs
    ctx.saved_fp8 = saved_fp8
    rows = (x_q, x_scale) if saved_fp8 else (x,)  # saved_fp8: x's values are never read
    ctx.save_for_backward(w_t, offs, *rows)
    ctx.gemm_args, ctx.wgrad_bf16 = split_forward_args(tuple(args))


def _backward_of(recipe: Recipe, rows: RowGemms):
    def backward(ctx, grad_out):
        w_t, offs, *rows_saved = ctx.saved_tensors
        grad_x = grad_w_t = None
        if ctx.needs_input_grad[0]:
            grad_x = recipe.op("grouped_mm_dgrad")(grad_out, w_t, offs, *ctx.gemm_args)
        if ctx.needs_input_grad[3]:
            fp8_wgrad = not ctx.wgrad_bf16 and (rows.fp8_wgrad_on_rows or not ctx.saved_fp8)
            if fp8_wgrad and ctx.saved_fp8 and rows.wgrad is not None:
                grad_w_t = recipe.op("grouped_mm_wgrad_on_rows")(grad_out, *rows_saved, offs, *ctx.gemm_args)
            else:
                x = rows.dequantize(*rows_saved) if ctx.saved_fp8 else rows_saved[0]
                grad_w_t = (recipe.op("grouped_mm_wgrad")(grad_out, x, offs, *ctx.gemm_args) if fp8_wgrad
                            else torch.ops.moepass.grouped_mm_wgrad_bf16(grad_out, x, offs))
            grad_w_t = weight_grad(grad_w_t, w_t)
        # x_q, x_scale, offs, saved_fp8, settings, wgrad_bf16, kernel get none
        return grad_x, None, None, grad_w_t, None, None, *(None,) * (len(ctx.gemm_args) + 1)

    return backward
