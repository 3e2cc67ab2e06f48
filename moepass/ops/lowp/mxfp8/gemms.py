"""The MXFP8 recipe's six GEMMs, which its recipe.py registers as moepass::mxfp8_linear, mxfp8_grouped_mm and their
_dgrad / _wgrad through the op families (ops/lowp/linear.py, grouped_mm.py).

Linears mirror torchao's mx_mm: y = x @ W.T + b with x and W quantized to MXFP8 along K; dgrad scales grad_out
and W along N; wgrad scales grad_out and x along tokens (padded with zero rows to a multiple of 32).
Grouped GEMMs are built on torchao's _compute_fwd / _compute_dgrad / _compute_wgrad, on token groups padded to
multiples of 32 rows (ops/lowp/token_group_padding.py); padding never reaches outputs or gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from moepass.torchao_import import torchao_import

from ..formats import E4M3
from ..grouped_wgrad_bf16 import as_transposed_layout
from ..token_group_padding import pad_token_groups, plan_token_group_padding, unpad_token_groups
from .kernels import kernel_preference, scale_mode

BF16 = torch.bfloat16
BLOCK = 32  # one E8M0 scale per 32 e4m3 elements along the reduction dim (the recipe's `multiple`)

# ---- linears


def _to_mx_along_rows(t: Tensor, scale_rounding: str, kernel: str):
    """MXTensor with 1x32 blocks along the last dim (torchao MXTensor.to_mx, Triton cast on sm100)."""
    with torchao_import():
        from torchao.prototype.mx_formats.config import MXFP8Dim0CastKernelChoice
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

    return MXTensor.to_mx(t.contiguous(), E4M3, BLOCK, scale_mode(scale_rounding), kernel_preference(kernel),
                          mxfp8_dim0_cast_kernel_choice=MXFP8Dim0CastKernelChoice.TRITON)


def _to_mx_along_cols(t: Tensor, scale_rounding: str, kernel: str):
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


def _kernel_weight(weight: Tensor) -> Tensor:
    """The weight as torchao's sm_100 casts take it: bf16 only (triton_to_mxfp8_dim0 asserts it), so an fp32 master
    weight is rounded to bf16 on this path alone (the emulated path quantizes it straight from fp32)."""
    return weight if weight.dtype == BF16 else weight.to(BF16)


def _emulated_mm_nt(a: Tensor, b: Tensor, scale_rounding: str) -> Tensor:
    """a [M, K] @ b [N, K].T with both quantized along K: torchao's emulated MX mm (a row-major, b column-major)."""
    return torch.mm(dequantized_rows(a, scale_rounding), dequantized_rows(b, scale_rounding).t())


def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], scale_rounding: str, kernel: str) -> Tensor:
    """y = x @ W.T (+ b): x and W scaled along K."""
    x2 = x.reshape(-1, x.shape[-1])
    if kernel == "emulated":
        y = _emulated_mm_nt(x2, weight, scale_rounding)
    else:
        y = torch.mm(_to_mx_along_rows(x2, scale_rounding, kernel),
                     _to_mx_along_rows(_kernel_weight(weight), scale_rounding, kernel).t())
    if bias is not None:
        y = y + bias  # bf16 add after the GEMM, as torchao's MXFP8Linear does (its quantize_ path drops bias)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_dgrad(grad_out: Tensor, weight: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_x = grad_out @ W, both scaled along N."""
    go = grad_out.reshape(-1, grad_out.shape[-1])
    if kernel == "emulated":
        grad_x = _emulated_mm_nt(go, weight.t(), scale_rounding)
    else:
        grad_x = torch.mm(_to_mx_along_rows(go, scale_rounding, kernel),
                          _to_mx_along_cols(_kernel_weight(weight), scale_rounding, kernel).t())
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def _pad_tokens(t: Tensor) -> Tensor:
    """[M, D] -> [round_up(M, 32), D] with zero rows: zeros add nothing to grad_out.T @ x."""
    return F.pad(t, (0, 0, 0, -t.shape[0] % BLOCK))


def linear_wgrad(grad_out: Tensor, x: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_W = grad_out.T @ x, both scaled along tokens."""
    go = _pad_tokens(grad_out.reshape(-1, grad_out.shape[-1]))
    xr = _pad_tokens(x.reshape(-1, x.shape[-1]))
    if kernel == "emulated":
        return _emulated_mm_nt(go.t(), xr.t(), scale_rounding)
    go_t_mx = _to_mx_along_cols(go, scale_rounding, kernel)  # [N, M]
    x_mx = _to_mx_along_cols(xr, scale_rounding, kernel).t()  # [M, K]
    return torch.mm(go_t_mx, x_mx)


# ---- grouped GEMMs


def grouped_forward(x: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """out = x[g] @ w_t[g] per token group, both scaled along K."""
    with torchao_import():
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_fwd

    plan = plan_token_group_padding(offs, x.shape[0], BLOCK)
    w_t = w_t if kernel == "emulated" else _kernel_weight(w_t)
    out = _compute_fwd(pad_token_groups(x, plan), as_transposed_layout(w_t), plan.padded_offs, BLOCK,
                       torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(out, plan)


def grouped_dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_x = grad_out @ w_t[g].T per group, scaled along N."""
    with torchao_import():
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_dgrad

    plan = plan_token_group_padding(offs, grad_out.shape[0], BLOCK)
    w_t = w_t if kernel == "emulated" else _kernel_weight(w_t)
    grad_x = _compute_dgrad(pad_token_groups(grad_out, plan), as_transposed_layout(w_t), plan.padded_offs,
                            BLOCK, torch.bfloat16, scale_mode(scale_rounding), kernel_preference(kernel))
    return unpad_token_groups(grad_x, plan)


def grouped_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, scale_rounding: str, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g], scaled along tokens."""
    with torchao_import():
        from torchao.prototype.moe_training.mxfp8_grouped_mm import _compute_wgrad

    plan = plan_token_group_padding(offs, x.shape[0], BLOCK)
    grad_w_t = _compute_wgrad(pad_token_groups(grad_out, plan), pad_token_groups(x, plan), plan.padded_offs,
                              BLOCK, torch.bfloat16, scale_mode(scale_rounding), False, kernel_preference(kernel))
    return as_transposed_layout(grad_w_t)
