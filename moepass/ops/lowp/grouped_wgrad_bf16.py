"""moepass::grouped_mm_wgrad_bf16: the BF16 weight gradient of a grouped expert GEMM (option `*.wgrad_bf16`).

grad_w_t[g] = x[g].T @ grad_out[g] over each token group, with torch._grouped_mm's 2d-2d form. Its CUDA
kernel needs 16-byte-aligned group starts along the token dim for a row-major left operand, and routed
groups are not aligned: it is only safe with the left operand column-major (grad_out.contiguous().t()) and
x row-major. Written inline in an autograd backward, Inductor chose the layouts itself and hit the kernel's
alignment assert on an H200 (16B model, fp8_rowwise.wgrad_bf16); as an opaque op the layouts are this
code's. Tokens at or after offs[-1] are not read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moepass.op_registry import register_gemm

from .gemm_args import check_bf16, check_offs
from .sharding import register_gemm_sharding


def as_transposed_layout(t: Tensor) -> Tensor:
    """[E, K, N] stored as [E, N, K] transposed: the layout of w_t = w.transpose(-2, -1), so w's grad needs no copy."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _check(grad_out: Tensor, x: Tensor, offs: Tensor) -> None:
    check_bf16("grouped_mm_wgrad_bf16", grad_out=grad_out, x=x)
    if grad_out.dim() != 2 or x.dim() != 2 or grad_out.shape[0] != x.shape[0]:
        raise ValueError(f"grouped_mm_wgrad_bf16: grad_out {tuple(grad_out.shape)} and x {tuple(x.shape)} "
                         "must be 2-D with the same tokens")
    check_offs("grouped_mm_wgrad_bf16", offs)


@torch.library.custom_op("moepass::grouped_mm_wgrad_bf16", mutates_args=())
def grouped_mm_wgrad_bf16(grad_out: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """[M, N], [M, K], offs [E] -> grad_w_t [E, K, N] (column-major, like w_t)."""
    _check(grad_out, x, offs)
    if x.shape[0] == 0:
        return as_transposed_layout(x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1]))
    return torch._grouped_mm(grad_out.contiguous().t(), x.contiguous(), offs=offs).transpose(-2, -1)


@grouped_mm_wgrad_bf16.register_fake
def _(grad_out, x, offs):
    _check(grad_out, x, offs)
    return as_transposed_layout(x.new_empty(offs.shape[0], x.shape[1], grad_out.shape[1]))


# torch._grouped_mm reads 16-byte-aligned rows: 8 bf16 elements
register_gemm_sharding(grouped_mm_wgrad_bf16._opoverload, "grouped_mm_wgrad", 8)
register_gemm(grouped_mm_wgrad_bf16._opoverload, "grouped", "wgrad")
