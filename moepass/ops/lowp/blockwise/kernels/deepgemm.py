"""Grouped blockwise FP8 GEMMs on DeepGEMM, through torchao 0.18's blockwise grouped op (kernel "deepgemm").

torchao's _Float8BlockwiseGroupedMM runs forward, dgrad and wgrad in one autograd.Function; moepass runs each as its
own op, so this module calls the same pieces per GEMM: token groups padded to 128 rows (token_group_padding's layout,
the one torchao's torch_pad_token_groups writes), torchao's Triton quantizers (scale = amax / 448, as ours), and its
DeepGEMM backend (M-grouped GEMMs for forward and dgrad, the K-grouped one for the wgrad). DeepGEMM is an optional
dependency, never vendored; choice.py uses this path only after deepgemm_check ran it against the emulated ops in a
child process. torchao is imported lazily: these are its private modules, pinned to 0.18 by the self-check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moepass.torchao_import import torchao_import

from ...formats import E4M3
from ...token_group_padding import TokenGroupPadding, pad_token_groups, plan_token_group_padding, unpad_token_groups
from ..quant import TILE

BF16 = torch.bfloat16


def _torchao():
    with torchao_import():
        from torchao.prototype.blockwise_fp8_training import kernels
        from torchao.prototype.moe_training.blockwise_fp8 import grouped_mm_backend
        from torchao.quantization.quantize_.common import KernelPreference

    return kernels, grouped_mm_backend, KernelPreference


def _backend(padded: Tensor, offs: Tensor, plan: TokenGroupPadding):
    """torchao's DeepGEMM backend for these padded groups (it owns the row layout the kernels read); raises when
    torchao would fall back to its emulated path instead."""
    _, grouped_mm_backend, kernel_preference = _torchao()
    ends = plan.padded_offs
    starts = (ends - torch.diff(ends, prepend=ends.new_zeros(1))).to(torch.int32)
    backend = grouped_mm_backend._select_fp8_blockwise_grouped_mm_backend(
        kernel_preference.AUTO, padded, BF16, TILE, ends, original_group_end_offsets=offs,
        padded_group_start_offsets=starts, num_rows=padded.shape[0])
    if backend.kind != grouped_mm_backend._GroupedMMBackendKind.DEEPGEMM:
        raise RuntimeError("torchao did not select its DeepGEMM backend (deep_gemm unusable on this device)")
    return backend


def _m_grouped(tokens: Tensor, offs: Tensor, quantize_rhs: str, w_t: Tensor) -> Tensor:
    """tokens [M, D] @ per-group right operand, D the reduction dim; quantize_rhs names the backend's quantizer."""
    kernels, _, _ = _torchao()
    plan = plan_token_group_padding(offs, tokens.shape[0], TILE)
    padded = pad_token_groups(tokens, plan)
    backend = _backend(padded, offs, plan)
    a_q, a_scale = kernels.triton_fp8_blockwise_act_quant_lhs(padded.contiguous(), block_size=TILE, dtype=E4M3)
    b_q, b_scale = getattr(backend, quantize_rhs)(w_t, TILE, E4M3)
    out = backend.grouped_mm(a_q, b_q, a_scale, kernels._scaling_type_value(kernels.BLOCKWISE_1X128_SCALING_TYPE),
                             b_scale, kernels._scaling_type_value(kernels.BLOCKWISE_128X128_SCALING_TYPE),
                             plan.padded_offs, BF16, TILE)
    return unpad_token_groups(out, plan)


def _bf16(w_t: Tensor) -> Tensor:
    """torchao's DeepGEMM weight quantizers are checked on bf16 weights only (deepgemm_check): an fp32 master weight is
    rounded to bf16 on this path alone."""
    return w_t if w_t.dtype == BF16 else w_t.to(BF16)


def forward(x: Tensor, w_t: Tensor, offs: Tensor) -> Tensor:
    """out = x[g] @ w_t[g] per token group; w_t [E, K, N] read per expert column-major, as torchao's op asserts."""
    from ...grouped_wgrad_bf16 import as_transposed_layout

    return _m_grouped(x, offs, "quantize_forward_rhs", as_transposed_layout(_bf16(w_t)))


def dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor) -> Tensor:
    """grad_x = grad_out[g] @ w_t[g].T per token group."""
    from ...grouped_wgrad_bf16 import as_transposed_layout

    return _m_grouped(grad_out, offs, "quantize_dgrad_rhs", as_transposed_layout(_bf16(w_t)))


def wgrad(grad_out: Tensor, x: Tensor, offs: Tensor) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g] -> [E, K, N] stored as [E, N, K] (w_t's layout)."""
    plan = plan_token_group_padding(offs, x.shape[0], TILE)
    padded_grad, padded_x = pad_token_groups(grad_out, plan), pad_token_groups(x, plan)
    backend = _backend(padded_x, offs, plan)
    grad_w = backend.wgrad(padded_grad, padded_x, plan.padded_offs, BF16, TILE, E4M3)  # [E, N, K]
    return grad_w.contiguous().transpose(-2, -1)
