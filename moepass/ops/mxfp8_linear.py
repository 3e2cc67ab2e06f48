"""MXFP8 linear GEMMs (moepass::mxfp8_linear, _dgrad, _wgrad; the op family is linear.py), mirroring torchao's mx_mm.

y = x @ W.T + b with x and W quantized to MXFP8 along K; dgrad scales grad_out and W along N;
wgrad scales grad_out and x along tokens (padded with zero rows to a multiple of 32).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .formats import E4M3, MX_BLOCK
from .linear import define_linear_ops
from .mxfp8_kernels import kernel_preference
from .mxfp8_recipe import MXFP8, scale_mode
from .op_recipe import RecipeGemms


def _to_mx_along_rows(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor with 1x32 blocks along the last dim (torchao MXTensor.to_mx, Triton cast on sm100)."""
    from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(t.contiguous(), E4M3, MX_BLOCK, scale_mode(scale_rounding), kernel_preference(kernel),
                          mxfp8_dim0_cast_kernel_choice=MXFP8Dim0CastKernelChoice.TRITON)


def _to_mx_along_cols(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor of t.T with 32x1 blocks down the columns of t (torchao's dim1 cast; CUDA kernel on sm100)."""
    from torchao.prototype.mx_formats.config import MXFP8Dim1CastKernelChoice
    from torchao.prototype.mx_formats.utils import _to_mxfp8_dim1_kernel_wrapper

    return _to_mxfp8_dim1_kernel_wrapper(t.contiguous(), MX_BLOCK, E4M3, t.dtype, kernel_preference(kernel),
                                         MXFP8Dim1CastKernelChoice.CUDA, scale_mode(scale_rounding))


def forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale_rounding: str, kernel: str) -> Tensor:
    """y = x @ W.T (+ b): x and W scaled along K."""
    x_mx = _to_mx_along_rows(x.reshape(-1, x.shape[-1]), scale_rounding, kernel)
    w_mx = _to_mx_along_rows(weight, scale_rounding, kernel)
    y = torch.mm(x_mx, w_mx.t())
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as torchao's MXFP8Linear does (its quantize_ path drops bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def dgrad(grad_out: Tensor, weight: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_x = grad_out @ W, both scaled along N."""
    go_mx = _to_mx_along_rows(grad_out.reshape(-1, grad_out.shape[-1]), scale_rounding, kernel)
    if kernel == "emulated":
        w_mx = _to_mx_along_rows(weight.t(), scale_rounding, kernel)
    else:
        w_mx = _to_mx_along_cols(weight, scale_rounding, kernel)
    grad_x = torch.mm(go_mx, w_mx.t())
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def _pad_tokens(t: Tensor) -> Tensor:
    """[M, D] -> [round_up(M, 32), D] with zero rows: zeros add nothing to grad_out.T @ x."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % MX_BLOCK))


def wgrad(grad_out: Tensor, x: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_W = grad_out.T @ x, both scaled along tokens."""
    go = _pad_tokens(grad_out.reshape(-1, grad_out.shape[-1]))
    xr = _pad_tokens(x.reshape(-1, x.shape[-1]))
    go_t_mx = _to_mx_along_cols(go, scale_rounding, kernel)  # [N, M]
    x_mx = _to_mx_along_cols(xr, scale_rounding, kernel).t()  # [M, K]
    return torch.mm(go_t_mx, x_mx)


define_linear_ops(MXFP8, RecipeGemms(forward, dgrad, wgrad))
