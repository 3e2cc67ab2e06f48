"""moepass::mxfp8_linear and its two backward GEMMs as separate ops, mirroring torchao's mx_mm.

y = x @ W.T + b with x and W quantized to MXFP8 along K; dgrad scales grad_out and W along N;
wgrad scales grad_out and x along tokens (padded with zero rows to a multiple of 32).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .gemm_args import check_bf16
from .mxfp8_args import BLOCK_SIZE, check_block_multiple, check_strings, scale_mode
from .mxfp8_kernels import kernel_preference

E4M3 = torch.float8_e4m3fn


def _to_mx_along_rows(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor with 1x32 blocks along the last dim (torchao MXTensor.to_mx, Triton cast on sm100)."""
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(t.contiguous(), E4M3, BLOCK_SIZE, scale_mode(scale_rounding), kernel_preference(kernel),
                          mxfp8_dim0_cast_kernel_choice=MXFP8Dim0CastKernelChoice.TRITON)


def _to_mx_along_cols(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor of t.T with 32x1 blocks down the columns of t (torchao's dim1 cast; CUDA kernel on sm100)."""
    from torchao.prototype.mx_formats.config import MXFP8Dim1CastKernelChoice
    from torchao.prototype.mx_formats.utils import _to_mxfp8_dim1_kernel_wrapper

    return _to_mxfp8_dim1_kernel_wrapper(t.contiguous(), BLOCK_SIZE, E4M3, t.dtype, kernel_preference(kernel),
                                         MXFP8Dim1CastKernelChoice.CUDA, scale_mode(scale_rounding))


def _check_linear(op: str, x: Tensor, weight: Tensor, scale_rounding: str, kernel: str) -> None:
    check_bf16(op, x=x, weight=weight)
    check_strings(scale_rounding, kernel, x.device)
    if weight.dim() != 2 or x.dim() < 1:
        raise ValueError(f"{op}: weight must be [N, K] and x [..., K], "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")


# ---- forward: y = x @ W.T (+ b) -----------------------------------------------------------------

def _check_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale_rounding: str, kernel: str) -> None:
    _check_linear("mxfp8_linear", x, weight, scale_rounding, kernel)
    check_bf16("mxfp8_linear", bias=bias)
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and tuple(bias.shape) != (n,)):
        raise ValueError(f"mxfp8_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)} do not form x @ weight.T + bias")
    check_block_multiple("mxfp8_linear", K=k, N=n)  # N: dgrad scales grad_out along N


@torch.library.custom_op("moepass::mxfp8_linear", mutates_args=())
def mxfp8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale_rounding: str, wgrad_bf16: bool,
                 kernel: str) -> Tensor:
    _check_forward(x, weight, bias, scale_rounding, kernel)
    x_mx = _to_mx_along_rows(x.reshape(-1, x.shape[-1]), scale_rounding, kernel)
    w_mx = _to_mx_along_rows(weight, scale_rounding, kernel)
    y = torch.mm(x_mx, w_mx.t())
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as torchao's MXFP8Linear does (its quantize_ path drops bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@mxfp8_linear.register_fake
def _(x, weight, bias, scale_rounding, wgrad_bf16, kernel):
    _check_forward(x, weight, bias, scale_rounding, kernel)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# ---- dgrad: grad_x = grad_out @ W, both scaled along N -------------------------------------------

def _check_dgrad(grad_out: Tensor, weight: Tensor, scale_rounding: str, kernel: str) -> None:
    _check_linear("mxfp8_linear_dgrad", grad_out, weight, scale_rounding, kernel)
    n, k = weight.shape
    if grad_out.shape[-1] != n:
        raise ValueError(f"mxfp8_linear_dgrad: grad_out {tuple(grad_out.shape)} "
                         f"does not match weight {tuple(weight.shape)}")
    check_block_multiple("mxfp8_linear_dgrad", K=k, N=n)


@torch.library.custom_op("moepass::mxfp8_linear_dgrad", mutates_args=())
def mxfp8_linear_dgrad(grad_out: Tensor, weight: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    _check_dgrad(grad_out, weight, scale_rounding, kernel)
    go_mx = _to_mx_along_rows(grad_out.reshape(-1, grad_out.shape[-1]), scale_rounding, kernel)
    if kernel == "emulated":
        w_mx = _to_mx_along_rows(weight.t(), scale_rounding, kernel)
    else:
        w_mx = _to_mx_along_cols(weight, scale_rounding, kernel)
    grad_x = torch.mm(go_mx, w_mx.t())
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


@mxfp8_linear_dgrad.register_fake
def _(grad_out, weight, scale_rounding, kernel):
    _check_dgrad(grad_out, weight, scale_rounding, kernel)
    return grad_out.new_empty(*grad_out.shape[:-1], weight.shape[1])


# ---- wgrad: grad_W = grad_out.T @ x, both scaled along tokens -----------------------------------

def _check_wgrad(grad_out: Tensor, x: Tensor, scale_rounding: str, kernel: str) -> None:
    check_bf16("mxfp8_linear_wgrad", grad_out=grad_out, x=x)
    check_strings(scale_rounding, kernel, x.device)
    if grad_out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"mxfp8_linear_wgrad: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must share leading (token) dims")
    check_block_multiple("mxfp8_linear_wgrad", K=x.shape[-1], N=grad_out.shape[-1])


def _pad_tokens(t: Tensor) -> Tensor:
    """[M, D] -> [round_up(M, 32), D] with zero rows: zeros add nothing to grad_out.T @ x."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % BLOCK_SIZE))


@torch.library.custom_op("moepass::mxfp8_linear_wgrad", mutates_args=())
def mxfp8_linear_wgrad(grad_out: Tensor, x: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    _check_wgrad(grad_out, x, scale_rounding, kernel)
    go = _pad_tokens(grad_out.reshape(-1, grad_out.shape[-1]))
    xr = _pad_tokens(x.reshape(-1, x.shape[-1]))
    go_t_mx = _to_mx_along_cols(go, scale_rounding, kernel)  # [N, M]
    x_mx = _to_mx_along_cols(xr, scale_rounding, kernel).t()  # [M, K]
    return torch.mm(go_t_mx, x_mx)


@mxfp8_linear_wgrad.register_fake
def _(grad_out, x, scale_rounding, kernel):
    _check_wgrad(grad_out, x, scale_rounding, kernel)
    return x.new_empty(grad_out.shape[-1], x.shape[-1])


# ---- autograd: the backward calls the two ops above so AOTAutograd's backward graph shows them ----

def _setup_context(ctx, inputs, output):
    x, weight, bias, scale_rounding, wgrad_bf16, kernel = inputs
    ctx.save_for_backward(x, weight)
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.scale_rounding, ctx.wgrad_bf16, ctx.kernel = scale_rounding, wgrad_bf16, kernel


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = torch.ops.moepass.mxfp8_linear_dgrad(grad_out, weight, ctx.scale_rounding, ctx.kernel)
    if ctx.needs_input_grad[1]:
        if ctx.wgrad_bf16:
            grad_w = torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        else:
            grad_w = torch.ops.moepass.mxfp8_linear_wgrad(grad_out, x, ctx.scale_rounding, ctx.kernel)
    if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
        # Sum over tokens with an fp32 accumulator, rounded once to the bias dtype.
        grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x, grad_w, grad_b, None, None, None


mxfp8_linear.register_autograd(_backward, setup_context=_setup_context)
