"""moepass::fp8_rowwise_grouped_mm (semantics of torch._grouped_mm(x, w_t, offs=offs)) and its backward GEMMs.

Forward: x per row, each expert's weight per output channel (along K); dgrad: grad_out per row, each
expert's weight per input channel (along N); wgrad: grad_out and x per (token group, column). GEMMs:
torch._scaled_grouped_mm on sm_90 (kernel "scaled_mm"), or exact dequantization and torch._grouped_mm
in BF16 (kernel "emulated", the same numerics). Token groups need no alignment: the 2d-3d GEMMs take any
group sizes, and the wgrad's operands are quantized straight into 16-aligned groups (fp8_rowwise_triton).
Rows at or after offs[-1] belong to no group: their outputs and input gradients are zero.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fp8_rowwise_quant as quant
from .fp8_rowwise_args import check_aligned
from .fp8_rowwise_kernels import require_kernel
from .gemm_args import check_bf16, check_offs
from .grouped_wgrad_bf16 import as_transposed_layout

FAST_ACCUM = True  # torchao's _Float8GroupedMM runs all three grouped GEMMs with fast accumulation


def _check_grouped(op: str, name: str, tokens: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> None:
    """tokens [M, K] (forward, name "x") or [M, N] (dgrad, name "grad_out") against w_t [E, K, N], offs int32 [E]."""
    check_bf16(op, **{name: tokens}, w_t=w_t)
    require_kernel(kernel, tokens.device, grouped=True)
    if tokens.dim() != 2 or w_t.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"{op}: expected {name} [M, D], w_t [E, K, N] and offs [E], got {tuple(tokens.shape)}, "
                         f"{tuple(w_t.shape)}, {tuple(offs.shape)}")
    check_offs(op, offs, w_t.shape[0])
    dim = 1 if name == "x" else 2
    if tokens.shape[1] != w_t.shape[dim]:
        raise ValueError(f"{op}: {name} {tuple(tokens.shape)} does not match w_t {tuple(w_t.shape)} "
                         f"along {'K' if dim == 1 else 'N'}")
    check_aligned(op, K=w_t.shape[1], N=w_t.shape[2])


def zero_rows_after_last_group(out: Tensor, offs: Tensor) -> Tensor:
    """Rows at or after offs[-1] set to zero by a pointwise select (Inductor fuses it into the consumer)."""
    rows = torch.arange(out.shape[0], device=out.device).unsqueeze(-1)
    return torch.where(rows < offs[-1:], out, out.new_zeros(()))


def _zero_rows_after_last_group(out: Tensor, offs: Tensor, kernel: str) -> Tensor:
    if kernel == "emulated":
        return zero_rows_after_last_group(out, offs)
    from .fp8_rowwise_triton import zero_rows_from_group_end_

    return zero_rows_from_group_end_(out, offs)


def scaled_grouped_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, offs: Tensor) -> Tensor:
    """torch._scaled_grouped_mm with our multipliers turned into its dequantization scales."""
    return torch._scaled_grouped_mm(a_q, b_q, a_scale.reciprocal(), b_scale.reciprocal(), offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)


# ---- forward ---------------------------------------------------------------------------------------

@torch.library.custom_op("moepass::fp8_rowwise_grouped_mm", mutates_args=())
def fp8_rowwise_grouped_mm(x: Tensor, w_t: Tensor, offs: Tensor, wgrad_bf16: bool, kernel: str) -> Tensor:
    _check_grouped("fp8_rowwise_grouped_mm", "x", x, w_t, offs, kernel)
    if x.shape[0] == 0:
        return x.new_zeros(0, w_t.shape[2])
    x_q, x_scale = quant.rows(x, kernel)  # [M, K], [M, 1]
    w_q, w_scale = quant.experts_along_k(w_t, kernel)  # [E, K, N] column-major, [E, 1, N]
    if kernel == "emulated":
        out = torch._grouped_mm(quant.dequantize(x_q, x_scale), quant.dequantize(w_q, w_scale), offs=offs)
    else:
        out = scaled_grouped_mm(x_q, x_scale.reshape(-1), w_q, w_scale.squeeze(1), offs)
    return _zero_rows_after_last_group(out, offs, kernel)


@fp8_rowwise_grouped_mm.register_fake
def _(x, w_t, offs, wgrad_bf16, kernel):
    _check_grouped("fp8_rowwise_grouped_mm", "x", x, w_t, offs, kernel)
    return x.new_empty(x.shape[0], w_t.shape[2])


# ---- dgrad: grad_x = grad_out @ w_t[g].T per group, scaled along N ----------------------------------

@torch.library.custom_op("moepass::fp8_rowwise_grouped_mm_dgrad", mutates_args=())
def fp8_rowwise_grouped_mm_dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, kernel: str) -> Tensor:
    _check_grouped("fp8_rowwise_grouped_mm_dgrad", "grad_out", grad_out, w_t, offs, kernel)
    if grad_out.shape[0] == 0:
        return grad_out.new_zeros(0, w_t.shape[1])
    g_q, g_scale = quant.rows(grad_out, kernel)  # [M, N], [M, 1]
    w_q, w_scale = quant.experts_along_n(w_t, kernel)  # [E, K, N] row-major, [E, K, 1]
    if kernel == "emulated":
        w = quant.dequantize(w_q, w_scale).transpose(-2, -1)
        grad_x = torch._grouped_mm(quant.dequantize(g_q, g_scale), w, offs=offs)
    else:
        grad_x = scaled_grouped_mm(g_q, g_scale.reshape(-1), w_q.transpose(-2, -1), w_scale.squeeze(-1), offs)
    return _zero_rows_after_last_group(grad_x, offs, kernel)


@fp8_rowwise_grouped_mm_dgrad.register_fake
def _(grad_out, w_t, offs, kernel):
    _check_grouped("fp8_rowwise_grouped_mm_dgrad", "grad_out", grad_out, w_t, offs, kernel)
    return grad_out.new_empty(grad_out.shape[0], w_t.shape[1])


# ---- wgrad: grad_w_t[g] = x[g].T @ grad_out[g], scaled along each group's tokens ---------------------

def _check_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, kernel: str) -> None:
    check_bf16("fp8_rowwise_grouped_mm_wgrad", grad_out=grad_out, x=x)
    require_kernel(kernel, x.device, grouped=True)
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"fp8_rowwise_grouped_mm_wgrad: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must be 2-D with the same tokens")
    check_offs("fp8_rowwise_grouped_mm_wgrad", offs)
    check_aligned("fp8_rowwise_grouped_mm_wgrad", K=x.shape[1], N=grad_out.shape[1])


@torch.library.custom_op("moepass::fp8_rowwise_grouped_mm_wgrad", mutates_args=())
def fp8_rowwise_grouped_mm_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, kernel: str) -> Tensor:
    _check_wgrad(grad_out, x, offs, kernel)
    if x.shape[0] == 0:
        return as_transposed_layout(x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1]))
    if kernel == "emulated":
        g_q, g_scale = quant.token_group_cols(grad_out, offs)  # [M, N], [E, N]
        x_q, x_scale = quant.token_group_cols(x, offs)  # [M, K], [E, K]
        g = quant.dequantize_token_groups(g_q, g_scale, offs)
        grad_w = torch._grouped_mm(g.t(), quant.dequantize_token_groups(x_q, x_scale, offs), offs=offs)
    else:
        from .fp8_rowwise_triton import token_group_cols_padded

        g_q_t, g_scale, padded_ends = token_group_cols_padded(grad_out, offs)  # [N, P] row-major
        x_q_t, x_scale, _ = token_group_cols_padded(x, offs)  # [K, P] row-major
        grad_w = scaled_grouped_mm(g_q_t, g_scale.reshape(-1), x_q_t.t(), x_scale.reshape(-1), padded_ends)
    return grad_w.transpose(-2, -1)  # [E, N, K] -> [E, K, N], column-major like w_t


@fp8_rowwise_grouped_mm_wgrad.register_fake
def _(grad_out, x, offs, kernel):
    _check_wgrad(grad_out, x, offs, kernel)
    return as_transposed_layout(x.new_empty(offs.shape[0], x.shape[1], grad_out.shape[1]))


# ---- autograd ----------------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    x, w_t, offs, wgrad_bf16, kernel = inputs
    ctx.save_for_backward(x, w_t, offs)
    ctx.wgrad_bf16, ctx.kernel = wgrad_bf16, kernel


def _backward(ctx, grad_out):
    x, w_t, offs = ctx.saved_tensors
    grad_x = grad_w_t = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.moepass.fp8_rowwise_grouped_mm_dgrad(grad_out, w_t, offs, ctx.kernel)
    if ctx.needs_input_grad[1]:
        if ctx.wgrad_bf16:
            grad_w_t = torch.ops.moepass.grouped_mm_wgrad_bf16(grad_out, x, offs)
        else:
            grad_w_t = torch.ops.moepass.fp8_rowwise_grouped_mm_wgrad(grad_out, x, offs, ctx.kernel)
    return grad_x, grad_w_t, None, None, None


fp8_rowwise_grouped_mm.register_autograd(_backward, setup_context=_setup_context)
