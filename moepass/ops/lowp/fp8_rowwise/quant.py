"""Rowwise e4m3 quantization: one fp32 scale per row (or column, or token group and column).

scale = 2^floor(log2(448 / max(amax, 1e-12))), q = e4m3(clamp(t * scale, -448, 448)); the GEMMs take
1 / scale, torch._scaled_mm's convention. These are the numerics of torchao's rowwise Triton kernels
with round_scales_to_power_of_2=True, written once here in plain torch (kernel "emulated", and the
"scaled_mm" path Inductor fuses: decomp) and dispatched to those kernels (the grouped ops'
eager "scaled_mm" path), which also lay the data out as the FP8 GEMMs read it.
Power-of-two scales make dequantization exact: the emulated BF16 GEMM sees the tensor cores' operands.

Every function returns (q, scale) with q of the input's logical shape and scale keeping the reduced dim, but
token_group_cols_padded, the reference of the wgrad's padded layout (kernels/token_group_cols.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moepass.torchao_import import torchao_import

from ..formats import E4M3, E4M3_MAX

AMAX_EPS = 1e-12  # torchao's floor on amax: an all-zero row gets a finite scale (and zero data)
ALIGN = 16  # torch._scaled_mm / _scaled_grouped_mm: K, N and the wgrad's token groups in 16-byte e4m3 rows
_EXPONENT_BITS = 0x7F800000


def scale_from_amax(amax: Tensor) -> Tensor:
    """fp32 multiplier mapping amax to at most 448, rounded down to a power of two."""
    scale = (E4M3_MAX / amax.double().clamp(min=AMAX_EPS)).float()
    return torch.bitwise_and(scale.view(torch.int32), _EXPONENT_BITS).view(torch.float32)


def quantize(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Reference: scales from the amax along `dim` (keepdim), data in t's shape, contiguous."""
    scale = scale_from_amax(t.abs().amax(dim=dim, keepdim=True).float())
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """Exact for power-of-two scales: every e4m3 value times 2^k is a bf16 value."""
    return (q.float() * scale.reciprocal()).to(torch.bfloat16)


def _torchao_kernels():
    with torchao_import():
        from torchao.prototype.moe_training import kernels

    return kernels


# ---- the four layouts the GEMMs need -----------------------------------------------------------

def rows(t: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """[R, C] -> q [R, C] row-major, scale [R, 1]: the left operand of every GEMM, and a linear's weight."""
    if kernel == "emulated":
        return quantize(t, -1)
    return _torchao_kernels().triton_fp8_rowwise_2d_scale_and_cast(t, E4M3, True)


def experts_along_k(w_t: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """Expert weights [E, K, N] -> q [E, K, N] column-major, scale [E, 1, N]: the grouped forward's right operand."""
    if kernel == "emulated":
        return quantize(w_t, 1)
    if w_t.stride(1) != 1:  # torchao's kernel reads w_t column-major, as models pass w.transpose(-2, -1)
        w_t = w_t.transpose(-2, -1).contiguous().transpose(-2, -1)
    return _torchao_kernels().triton_fp8_colwise_3d_scale_and_cast(w_t, E4M3, True)


def experts_along_n(w_t: Tensor, kernel: str) -> tuple[Tensor, Tensor]:
    """Expert weights [E, K, N] -> q [E, K, N] row-major, scale [E, K, 1]: q.transpose(-2, -1) is dgrad's operand."""
    if kernel == "emulated":
        return quantize(w_t, 2)
    q_t, scale = _torchao_kernels().triton_fp8_rowwise_3d_transpose_rhs(w_t, E4M3, True)
    return q_t.transpose(-2, -1), scale.unsqueeze(-1)


def _token_group(offs: Tensor, num_tokens: int) -> Tensor:
    """Group index of each token; E for tokens at or after offs[-1]."""
    tokens = torch.arange(num_tokens, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, tokens, right=True).long()


def token_group_cols(t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: [M, D] -> q [M, D], scale [E, D] from each token group's column amax.

    Tokens at or after offs[-1] belong to no group; their rows of q are not meaningful.
    """
    experts = offs.shape[0]
    group = _token_group(offs, t.shape[0])
    amax = t.new_zeros(experts + 1, t.shape[1], dtype=torch.float32).scatter_reduce_(
        0, group.unsqueeze(-1).expand(t.shape), t.abs().float(), "amax")
    scale = scale_from_amax(amax)
    q = (t.float() * scale[group]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale[:experts]


def dequantize_token_groups(q: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """Inverse of token_group_cols (rows past offs[-1] take the last group's scale; no GEMM reads them)."""
    return dequantize(q, scale[_token_group(offs, q.shape[0]).clamp(max=offs.shape[0] - 1)])


def padded_token_rows(tokens: int, experts: int) -> int:
    """Rows of the padded layout: each group grows by at most ALIGN rows (an empty one by exactly ALIGN)."""
    return (tokens + ALIGN * experts + ALIGN - 1) // ALIGN * ALIGN


def token_group_cols_padded(t: Tensor, offs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Reference: [M, D] -> (q [D, P] row-major, scale [E, D], padded group ends int32 [E]), token_group_cols laid out
    as the Triton kernel writes it (kernels/triton_token_group_cols.py): each group from a multiple of 16 columns on,
    zero-padded to a multiple of 16 (at least 16)."""
    q, scale = token_group_cols(t, offs)
    ends = offs.tolist()
    sizes = [end - begin for begin, end in zip([0, *ends[:-1]], ends)]
    padded_sizes = [max(-(-size // ALIGN) * ALIGN, ALIGN) for size in sizes]
    q_t = torch.zeros(t.shape[1], padded_token_rows(t.shape[0], len(ends)), dtype=torch.uint8, device=t.device)
    begin = padded_begin = 0
    for size, padded_size in zip(sizes, padded_sizes):
        q_t[:, padded_begin:padded_begin + size] = q[begin:begin + size].t().view(torch.uint8)
        begin, padded_begin = begin + size, padded_begin + padded_size
    padded_ends = torch.tensor(padded_sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(t.device)
    return q_t.view(E4M3), scale, padded_ends
