"""The FP8-rowwise ops' "scaled_mm" kernel in plain torch, and the decomposition table that hands it to Inductor.

Inside an opaque custom op the rowwise quantization is its own kernels, unfused and (torchao's) autotuned
per shape. Decomposed by AOTAutograd, Inductor sees amax -> power-of-two scale -> e4m3 cast as ordinary
ops: one fused reduction kernel per operand, which can also absorb the operand's producer (RMSNorm,
SiLU * up) and a transposed write, while torch._scaled_mm / _scaled_grouped_mm stay the GEMMs.
Same numbers as the ops: quant.quantize (power-of-two scales), the same layouts, scale
shapes, padding and GEMM primitives (kernels/scaled_gemms.py, FAST_ACCUM included). The linear ops run these same
functions eagerly for "scaled_mm".

Column-major operands are quantized as `t.t()` along its last dim into a row-major buffer, then viewed
back with `.t()`: Inductor writes the transposed layout from the quantization kernel itself.
The grouped wgrad decomposes into two moepass::fp8_rowwise_token_group_cols (a Triton kernel writing the
padded token-group layout) and the GEMM: the quantization of x that w1's and w3's wgrads share is CSE'd. Its form
on the FP8 rows quantize_once saves (grouped_mm_wgrad_on_rows) hands the token-group kernel those rows and scales.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..inductor_fallbacks import register_fallbacks
from . import quant
from .kernels.scaled_gemms import scaled_grouped_mm, scaled_mm, zero_rows_after_last_group


# ---- operands in the layouts the FP8 GEMMs read --------------------------------------------------

def rows(t: Tensor) -> tuple[Tensor, Tensor]:
    """[..., R, C] -> q row-major, scale [..., R, 1]: scaled along the last dim."""
    q, scale = quant.quantize(t, -1)
    return q.contiguous(), scale


def cols(t: Tensor) -> tuple[Tensor, Tensor]:
    """[..., R, C] -> q [..., R, C] column-major, scale [..., 1, C]: scaled down each column."""
    q_t, scale = rows(t.transpose(-2, -1))
    return q_t.transpose(-2, -1), scale.transpose(-2, -1)


def rows_of(t: Tensor, both_layouts: bool) -> tuple[Tensor, Tensor]:
    """rows(t), or the row half of moepass::fp8_rowwise_rows_and_cols(t), which the GEMM reading t's columns
    calls too (CSE leaves one call: both_layouts). t must have tokens for its columns' amax."""
    if both_layouts and not _maybe_empty(t.shape[0]):
        return tuple(torch.ops.moepass.fp8_rowwise_rows_and_cols(t)[:2])
    return rows(t)


def cols_of(t: Tensor, both_layouts: bool) -> tuple[Tensor, Tensor]:
    """cols(t), or the column half of moepass::fp8_rowwise_rows_and_cols(t) (see rows_of)."""
    return tuple(torch.ops.moepass.fp8_rowwise_rows_and_cols(t)[2:]) if both_layouts else cols(t)


def pad_tokens(t: Tensor) -> Tensor:
    """[M, D] -> [round_up(M, 16), D] with zero rows: torch._scaled_mm needs its reduction dim % 16 == 0."""
    missing = -t.shape[0] % quant.ALIGN
    return t if statically_known_true(missing == 0) else F.pad(t, (0, 0, 0, missing))


# ---- the six GEMMs, kernel "scaled_mm" ----------------------------------------------------------

def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], inputs_both: bool = False,
           weights_once: bool = False) -> Tensor:
    """moepass::fp8_rowwise_linear: x per token and W per output channel, both along K.

    inputs_both: x through moepass::fp8_rowwise_rows_and_cols, whose column half the wgrad takes (saved in FP8).
    weights_once: W through moepass::fp8_rowwise_rows_and_cols too, whose column half the dgrad takes.
    """
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    x_q, x_scale = rows_of(pad_tokens(x2), inputs_both)
    w_q, w_scale = rows_of(weight, weights_once)  # [N, K] row-major: its .t() is the column-major right operand
    y = scaled_mm(x_q, x_scale, w_q.t(), w_scale.t(), "fwd")[:tokens]
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as the op does
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_dgrad(grad_out: Tensor, weight: Tensor, grads_both: bool = False, weights_once: bool = False) -> Tensor:
    """moepass::fp8_rowwise_linear_dgrad: grad_out per token and W per input channel, both along N.

    grads_both: grad_out through moepass::fp8_rowwise_rows_and_cols, whose column half the wgrad takes.
    weights_once: W's column half of the forward's moepass::fp8_rowwise_rows_and_cols(W) (CSE: one call).
    """
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    tokens = g2.shape[0]
    g_q, g_scale = rows_of(pad_tokens(g2), grads_both)
    w_q, w_scale = cols_of(weight, weights_once)  # [N, K] column-major, [1, K]
    grad_x = scaled_mm(g_q, g_scale, w_q, w_scale, "dgrad")[:tokens]
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def linear_wgrad(grad_out: Tensor, x: Tensor, grads_both: bool = False, inputs_both: bool = False) -> Tensor:
    """moepass::fp8_rowwise_linear_wgrad: grad_out.T @ x, both scaled along tokens (zero rows pad tokens to 16)."""
    g2, x2 = pad_tokens(grad_out.reshape(-1, grad_out.shape[-1])), pad_tokens(x.reshape(-1, x.shape[-1]))
    g_q, g_scale = cols_of(g2, grads_both)  # [M, N] column-major: .t() is row-major [N, M], scale [N, 1]
    x_q, x_scale = cols_of(x2, inputs_both)  # [M, K] column-major, [1, K]
    return scaled_mm(g_q.t(), g_scale.t(), x_q, x_scale, "wgrad")


def grouped_mm(x: Tensor, w_t: Tensor, offs: Tensor, weights_once: bool = False) -> Tensor:
    """moepass::fp8_rowwise_grouped_mm: x per token, each expert's weight per output channel (along K).

    weights_once: the weight through moepass::fp8_rowwise_expert_weights, which the dgrad calls too (one pass).
    """
    return grouped_mm_on_rows(*rows(x), w_t, offs, weights_once)  # x: [M, K], [M, 1]


def grouped_mm_on_rows(x_q: Tensor, x_scale: Tensor, w_t: Tensor, offs: Tensor, weights_once: bool = False) -> Tensor:
    """moepass::fp8_rowwise_grouped_mm_on_rows: grouped_mm on x already quantized per row."""
    if weights_once:
        w_q, w_scale, _, _ = torch.ops.moepass.fp8_rowwise_expert_weights(w_t)
    else:
        w_q, w_scale = cols(w_t)  # [E, K, N] column-major, [E, 1, N]
    out = scaled_grouped_mm(x_q, x_scale.reshape(-1), w_q, w_scale.squeeze(1), offs)
    return zero_rows_after_last_group(out, offs)


def grouped_mm_dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, weights_once: bool = False) -> Tensor:
    """moepass::fp8_rowwise_grouped_mm_dgrad: grad_out per token, each expert's weight per input channel (along N)."""
    g_q, g_scale = rows(grad_out)  # [M, N], [M, 1]
    if weights_once:  # the same call as the forward's: CSE leaves one, in the forward, saving this half
        _, _, w_q, w_scale = torch.ops.moepass.fp8_rowwise_expert_weights(w_t)
    else:
        w_q, w_scale = rows(w_t)  # [E, K, N] row-major: its transpose is dgrad's column-major [E, N, K]
    grad_x = scaled_grouped_mm(g_q, g_scale.reshape(-1), w_q.transpose(-2, -1), w_scale.squeeze(-1), offs)
    return zero_rows_after_last_group(grad_x, offs)


def grouped_mm_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """moepass::fp8_rowwise_grouped_mm_wgrad: grad_w_t[g] = x[g].T @ grad_out[g], scaled along the group's tokens."""
    return _grouped_wgrad(grad_out, torch.ops.moepass.fp8_rowwise_token_group_cols(x, offs), offs)


def grouped_mm_wgrad_on_rows(grad_out: Tensor, x_q: Tensor, x_scale: Tensor, offs: Tensor) -> Tensor:
    """moepass::fp8_rowwise_grouped_mm_wgrad_on_rows: grouped_mm_wgrad on x = dequantize(x_q, x_scale), read in FP8."""
    return _grouped_wgrad(grad_out, torch.ops.moepass.fp8_rowwise_token_group_cols(x_q, offs, x_scale), offs)


def _grouped_wgrad(grad_out: Tensor, x_cols: tuple[Tensor, Tensor, Tensor], offs: Tensor) -> Tensor:
    g_q_t, g_scale, padded_ends = torch.ops.moepass.fp8_rowwise_token_group_cols(grad_out, offs)  # [N, P]
    x_q_t, x_scale, _ = x_cols  # [K, P], [E, K]
    grad_w = scaled_grouped_mm(g_q_t, g_scale.reshape(-1), x_q_t.t(), x_scale.reshape(-1), padded_ends)
    return grad_w.transpose(-2, -1)  # [E, N, K] -> [E, K, N], column-major like w_t


# ---- decompositions: only kernel "scaled_mm"; "emulated" stays the op it is -------------------------

def _maybe_empty(m) -> bool:
    """Token count not known to be positive (0, or data dependent): keep the op, which handles zero tokens."""
    return not statically_known_true(m > 0)


def _decompose_linear(x, weight, bias, wgrad_bf16, kernel, both=(), weights_once=False):
    if kernel != "scaled_mm":
        return NotImplemented
    return linear(x, weight, bias, inputs_both="inputs" in both and not wgrad_bf16, weights_once=weights_once)


def _decompose_linear_dgrad(grad_out, weight, kernel, both=(), weights_once=False):
    if kernel != "scaled_mm":
        return NotImplemented
    return linear_dgrad(grad_out, weight, "grads" in both, weights_once)


def _decompose_linear_wgrad(grad_out, x, kernel, both=()):
    if kernel != "scaled_mm" or _maybe_empty(math.prod(grad_out.shape[:-1])):  # amax over no tokens fails
        return NotImplemented
    return linear_wgrad(grad_out, x, "grads" in both, "inputs" in both)


def _decompose_grouped_mm(x, w_t, offs, wgrad_bf16, kernel, weights_once=False):
    if kernel != "scaled_mm" or _maybe_empty(x.shape[0]):
        return NotImplemented
    return grouped_mm(x, w_t, offs, weights_once)


def _decompose_grouped_mm_dgrad(grad_out, w_t, offs, kernel, weights_once=False):
    if kernel != "scaled_mm" or _maybe_empty(grad_out.shape[0]):
        return NotImplemented
    return grouped_mm_dgrad(grad_out, w_t, offs, weights_once)


def _decompose_grouped_mm_wgrad(grad_out, x, offs, kernel):
    if kernel != "scaled_mm" or _maybe_empty(x.shape[0]):
        return NotImplemented
    return grouped_mm_wgrad(grad_out, x, offs)


def _decompose_grouped_mm_wgrad_on_rows(grad_out, x_q, x_scale, offs, kernel):
    if kernel != "scaled_mm" or _maybe_empty(x_q.shape[0]):
        return NotImplemented
    return grouped_mm_wgrad_on_rows(grad_out, x_q, x_scale, offs)


def _decompose_quantize_rows(x, kernel):
    if kernel != "scaled_mm" or _maybe_empty(x.shape[0]):
        return NotImplemented
    return rows(x)


def _decompose_grouped_mm_on_rows(x_q, x_scale, w_t, offs, kernel, weights_once=False):
    if kernel != "scaled_mm" or _maybe_empty(x_q.shape[0]):
        return NotImplemented
    return grouped_mm_on_rows(x_q, x_scale, w_t, offs, weights_once)


# fp8_rowwise.linear_both_layouts -> the linear operands quantized into both layouts by one op
LINEAR_BOTH_LAYOUTS = {"none": (), "grads": ("grads",), "grads_and_inputs": ("grads", "inputs")}


def _with(fn, **kwargs):
    return functools.wraps(fn)(functools.partial(fn, **kwargs)) if any(kwargs.values()) else fn


def fp8_rowwise_decompositions(expert_weights_once: bool = False, linear_both_layouts: str = "none",
                               linear_weights_once: bool = False) -> dict:
    """{OpOverload: decomposition} for compile_fx(..., decompositions=...), merged over Inductor's own table.

    expert_weights_once, linear_both_layouts, linear_weights_once: the options fp8_rowwise.* of those names
    (moepass/ops/lowp/fp8_rowwise/kernels/both_layouts.py).
    """
    ops = torch.ops.moepass
    both = LINEAR_BOTH_LAYOUTS[linear_both_layouts]
    return {
        ops.fp8_rowwise_linear.default: _with(_decompose_linear, both=both, weights_once=linear_weights_once),
        ops.fp8_rowwise_linear_dgrad.default: _with(_decompose_linear_dgrad, both=both,
                                                    weights_once=linear_weights_once),
        ops.fp8_rowwise_linear_wgrad.default: _with(_decompose_linear_wgrad, both=both),
        ops.fp8_rowwise_grouped_mm.default: _with(_decompose_grouped_mm, weights_once=expert_weights_once),
        ops.fp8_rowwise_grouped_mm_dgrad.default: _with(_decompose_grouped_mm_dgrad, weights_once=expert_weights_once),
        ops.fp8_rowwise_grouped_mm_wgrad.default: _decompose_grouped_mm_wgrad,
        ops.fp8_rowwise_grouped_mm_wgrad_on_rows.default: _decompose_grouped_mm_wgrad_on_rows,
        ops.fp8_rowwise_quantize_rows.default: _decompose_quantize_rows,
        ops.fp8_rowwise_grouped_mm_on_rows.default: _with(_decompose_grouped_mm_on_rows,
                                                          weights_once=expert_weights_once),
    }


def inductor_decompositions(expert_weights_once: bool = False, linear_both_layouts: str = "none",
                            linear_weights_once: bool = False) -> dict:
    """Inductor's default table plus ours: what the moepass backend passes to compile_fx."""
    from torch._inductor.decomposition import select_decomp_table

    register_inductor_fallbacks()
    return {**select_decomp_table(),
            **fp8_rowwise_decompositions(expert_weights_once, linear_both_layouts, linear_weights_once)}


@functools.lru_cache(maxsize=None)
def register_inductor_fallbacks() -> None:
    """Lowerings for the ops a decomposition declines (kernel "emulated", maybe-empty tokens)."""
    register_fallbacks(fp8_rowwise_decompositions())
