"""moepass::fp8_rowwise_linear and its two backward GEMMs as separate ops: the Hopper-native FP8 recipe.

y = x @ W.T (+ b) with x scaled per row and W per output channel (both along K); dgrad scales grad_out
per row and W per input channel (both along N); wgrad scales grad_out and x per column (along tokens).
Every scale is a power of two (fp8_rowwise_quant); the GEMMs are torch._scaled_mm on sm_89+
(kernel "scaled_mm") or exact dequantization and a BF16 GEMM (kernel "emulated", same numerics).
Kernel "scaled_mm" runs fp8_rowwise_decomp's plain-torch quantization: eagerly here, and fused by Inductor
when the moepass backend decomposes these ops (so eager and compiled share one definition, no autotuning).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import fp8_rowwise_quant as quant
from .fp8_rowwise_args import check_aligned
from .fp8_rowwise_kernels import require_kernel
from .gemm_args import check_bf16

# torchao Float8Linear's rowwise defaults: fast accumulation only where the reduction is over K of the
# forward; the gradients reduce over N or over all tokens and keep CUTLASS's fp32 promotion.
FAST_ACCUM = {"fwd": True, "dgrad": False, "wgrad": False}


def _emulated_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor) -> Tensor:
    """a [M, K] (scale [M, 1]) @ b [K, N] (scale [1, N]) -> bf16 [M, N], dequantized exactly."""
    return torch.mm(quant.dequantize(a_q, a_scale), quant.dequantize(b_q, b_scale))


def _decomp():
    from . import fp8_rowwise_decomp  # imports this module: loaded on first use

    return fp8_rowwise_decomp


def _check_linear(op: str, name: str, t: Tensor, weight: Tensor, kernel: str) -> None:
    check_bf16(op, **{name: t}, weight=weight)
    require_kernel(kernel, t.device, grouped=False)
    if weight.dim() != 2 or t.dim() < 1:
        raise ValueError(f"{op}: weight must be [N, K] and {name} [..., D], "
                         f"got {name} {tuple(t.shape)}, weight {tuple(weight.shape)}")


# ---- forward: y = x @ W.T (+ b) -----------------------------------------------------------------

def _check_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], kernel: str) -> None:
    _check_linear("fp8_rowwise_linear", "x", x, weight, kernel)
    check_bf16("fp8_rowwise_linear", bias=bias)
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"fp8_rowwise_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not form x @ weight.T + bias")
    check_aligned("fp8_rowwise_linear", K=k, N=n)  # N: dgrad contracts over it


@torch.library.custom_op("moepass::fp8_rowwise_linear", mutates_args=())
def fp8_rowwise_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], wgrad_bf16: bool, kernel: str) -> Tensor:
    _check_forward(x, weight, bias, kernel)
    x2 = x.reshape(-1, x.shape[-1])
    tokens = x2.shape[0]
    if tokens and kernel == "scaled_mm":
        return _decomp().linear(x, weight, bias)
    if tokens == 0:
        y = x2.new_zeros(0, weight.shape[0])
    else:
        x_q, x_scale = quant.quantize(x2, -1)
        w_q, w_scale = quant.quantize(weight, -1)
        y = _emulated_mm(x_q, x_scale, w_q.t(), w_scale.reshape(1, -1))
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as the MXFP8 linear does
    return y.reshape(*x.shape[:-1], weight.shape[0])


@fp8_rowwise_linear.register_fake
def _(x, weight, bias, wgrad_bf16, kernel):
    _check_forward(x, weight, bias, kernel)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- dgrad: grad_x = grad_out @ W, both scaled along N -------------------------------------------

def _check_dgrad(grad_out: Tensor, weight: Tensor, kernel: str) -> None:
    _check_linear("fp8_rowwise_linear_dgrad", "grad_out", grad_out, weight, kernel)
    n, k = weight.shape
    if grad_out.shape[-1] != n:
        raise ValueError(f"fp8_rowwise_linear_dgrad: grad_out {tuple(grad_out.shape)} "
                         f"does not match weight {tuple(weight.shape)}")
    check_aligned("fp8_rowwise_linear_dgrad", K=k, N=n)


@torch.library.custom_op("moepass::fp8_rowwise_linear_dgrad", mutates_args=())
def fp8_rowwise_linear_dgrad(grad_out: Tensor, weight: Tensor, kernel: str) -> Tensor:
    _check_dgrad(grad_out, weight, kernel)
    g2 = grad_out.reshape(-1, grad_out.shape[-1])
    tokens = g2.shape[0]
    if tokens == 0:
        return grad_out.new_zeros(*grad_out.shape[:-1], weight.shape[1])
    if kernel == "scaled_mm":
        return _decomp().linear_dgrad(grad_out, weight)
    g_q, g_scale = quant.quantize(g2, -1)
    w_q, w_scale = quant.quantize(weight, 0)
    grad_x = _emulated_mm(g_q, g_scale, w_q, w_scale)
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


@fp8_rowwise_linear_dgrad.register_fake
def _(grad_out, weight, kernel):
    _check_dgrad(grad_out, weight, kernel)
    return grad_out.new_empty(*grad_out.shape[:-1], weight.shape[1])


# ---- wgrad: grad_W = grad_out.T @ x, both scaled along tokens -----------------------------------

def _check_wgrad(grad_out: Tensor, x: Tensor, kernel: str) -> None:
    check_bf16("fp8_rowwise_linear_wgrad", grad_out=grad_out, x=x)
    require_kernel(kernel, x.device, grouped=False)
    if grad_out.dim() < 1 or grad_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"fp8_rowwise_linear_wgrad: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must share leading (token) dims")
    check_aligned("fp8_rowwise_linear_wgrad", K=x.shape[-1], N=grad_out.shape[-1])


@torch.library.custom_op("moepass::fp8_rowwise_linear_wgrad", mutates_args=())
def fp8_rowwise_linear_wgrad(grad_out: Tensor, x: Tensor, kernel: str) -> Tensor:
    _check_wgrad(grad_out, x, kernel)
    g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
    if g2.shape[0] == 0:
        return x.new_zeros(g2.shape[1], x2.shape[1])  # no tokens: no column has an amax
    if kernel == "scaled_mm":
        return _decomp().linear_wgrad(grad_out, x)
    g_q, g_scale = quant.quantize(g2, 0)  # scaled per column, along tokens
    x_q, x_scale = quant.quantize(x2, 0)
    return _emulated_mm(g_q.t(), g_scale.reshape(-1, 1), x_q, x_scale)


@fp8_rowwise_linear_wgrad.register_fake
def _(grad_out, x, kernel):
    _check_wgrad(grad_out, x, kernel)
    return x.new_empty(grad_out.shape[-1], x.shape[-1])


# ---- autograd: the backward calls the two ops above so AOTAutograd's backward graph shows them ----

def _setup_context(ctx, inputs, output):
    x, weight, bias, wgrad_bf16, kernel = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.wgrad_bf16, ctx.kernel = wgrad_bf16, kernel


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.moepass.fp8_rowwise_linear_dgrad(grad_out, weight, ctx.kernel)
    if ctx.needs_input_grad[1]:
        if ctx.wgrad_bf16:
            grad_w = torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        else:
            grad_w = torch.ops.moepass.fp8_rowwise_linear_wgrad(grad_out, x, ctx.kernel)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        # Sum over tokens with an fp32 accumulator, rounded once to the bias dtype.
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b, None, None


fp8_rowwise_linear.register_autograd(_backward, setup_context=_setup_context)
