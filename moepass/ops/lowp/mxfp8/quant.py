"""MXFP8 quantization: e4m3 elements with one E8M0 scale per 32 along a GEMM's reduction dim, through torchao's MX
formats (MXTensor.to_mx, its dim1 cast; Triton and CUDA kernels on sm100, plain torch when emulated)."""

from __future__ import annotations

import torch
from torch import Tensor

from moepass.torchao_import import torchao_import

from ..formats import E4M3
from .kernels.choice import kernel_preference, scale_mode

BF16 = torch.bfloat16
BLOCK = 32  # one E8M0 scale per 32 e4m3 elements along the reduction dim (the recipe's `multiple`)


def to_mx_along_rows(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor with 1x32 blocks along the last dim (torchao MXTensor.to_mx, Triton cast on sm100)."""
    with torchao_import():
        from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(t.contiguous(), E4M3, BLOCK, scale_mode(scale_rounding), kernel_preference(kernel),
                          mxfp8_dim0_cast_kernel_choice=MXFP8Dim0CastKernelChoice.TRITON)


def to_mx_along_cols(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor of t.T with 32x1 blocks down the columns of t (torchao's dim1 cast; CUDA kernel on sm100)."""
    with torchao_import():
        from torchao.prototype.mx_formats.config import MXFP8Dim1CastKernelChoice
        from torchao.prototype.mx_formats.utils import _to_mxfp8_dim1_kernel_wrapper

    return _to_mxfp8_dim1_kernel_wrapper(t.contiguous(), BLOCK, E4M3, t.dtype, kernel_preference(kernel),
                                         MXFP8Dim1CastKernelChoice.CUDA, scale_mode(scale_rounding))


def dequantized_rows(t: Tensor, scale_rounding: str) -> Tensor:
    """t [R, C] (bf16, or an fp32 weight) quantized to MXFP8 along C (1x32 blocks) and dequantized to BF16: torchao's
    emulated numerics (to_mx, then MXTensor.dequantize's e4m3 -> BF16 cast times the BF16 power-of-two scale; exact),
    in plain torch so Inductor can fuse it (decomp.py)."""
    with torchao_import():
        from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    scale, q = to_mx(t.contiguous(), E4M3, BLOCK, scale_mode(scale_rounding))
    blocks = q.to(BF16).reshape(-1, BLOCK) * get_fp_scale(scale).reshape(-1, 1).to(BF16)
    return blocks.reshape(t.shape)


def kernel_weight(weight: Tensor) -> Tensor:
    """The weight as torchao's sm_100 casts take it: bf16 only (triton_to_mxfp8_dim0 asserts it), so an fp32 master
    weight is rounded to bf16 on this path alone (the emulated path quantizes it straight from fp32)."""
    return weight if weight.dtype == BF16 else weight.to(BF16)
