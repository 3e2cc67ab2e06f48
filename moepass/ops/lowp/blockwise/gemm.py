"""The one blockwise FP8 GEMM every op runs: out = A @ B.T, both operands K-major (the "NT" form DeepGEMM uses too).

A [M, K] in 1x128 tiles along K (scale [M, K/128]); B [N, K] in 128x128 blocks (scale [N/128, K/128]: the forward's
and dgrad's weights) or in 1x128 tiles (scale [N, K/128]: the wgrad's second operand, both tiled along tokens).

kernel "emulated": both dequantized to fp32, an fp32 GEMM, the result rounded to bf16 (the numerics reference).
kernel "scaled_mm": torch._scaled_mm on sm_90, which takes DeepSeek's scales (torch 2.11-2.13, aten ScaledBlas.cpp
get_joint_scaling: is_blockwise_1x128_scaling(a, scale_a) and is_blockwise_*(b.t(), scale_b.t())):
    a = A row-major; scale_a [M, K/128] with strides (1, M) ("outer-dim-major": built as s.t().contiguous().t())
    b = B.t() column-major
    128x128: scale_b.t() must be [N/128, K/128] row-major: scale_b = B's block scales .t()
    1x128:   scale_b.t() must be [N, K/128] with strides (1, N): scale_b = B's tile scales .t().contiguous()
cuBLASLt reads 128x128 scales K-major with a row stride of round_up(K/128, 4) (16-byte aligned; torchao pads them so
for _scaled_mm_v2), while torch's check on them wants exactly K/128 in some versions and the rounded stride in others:
K is zero-padded to a multiple of 512, where both agree (zeros add nothing; only shapes with K/128 % 4 != 0 pay a
copy). A's rows are zero-padded to a multiple of 16 likewise, so every scale column starts 16-byte aligned.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import quant

BF16 = torch.bfloat16
TILE = quant.TILE
K_ALIGN = 4 * TILE  # K/128 a multiple of 4: 128x128 scale rows 16 bytes apart, as cuBLASLt reads them
ROW_ALIGN = 16  # A's rows: each 1x128 scale column (M fp32 values) 16-byte aligned
USE_FAST_ACCUM = False  # each 128-wide K block's partial sum is scaled and accumulated in fp32 (DeepSeek's promotion)


def outer_dim_major(scale: Tensor) -> Tensor:
    """[R, C] with strides (1, R): the layout torch._scaled_mm reads 1x128 scales in."""
    return scale.t().contiguous().t()


def _padded(t: Tensor, rows: int, cols: int, value: float = 0.0) -> Tensor:
    """t [R, C] zero-padded (or `value`-padded) to [rows, cols]; e4m3 data padded through its bytes (0 is +0.0)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t.contiguous()
    if t.dtype == torch.float8_e4m3fn:
        return torch.nn.functional.pad(t.view(torch.uint8), (0, cols - c, 0, rows - r)).view(t.dtype)
    return torch.nn.functional.pad(t, (0, cols - c, 0, rows - r), value=value)


def scaled_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, b_blocks: bool) -> Tensor:
    """torch._scaled_mm of A [M, K] @ B [N, K].T with blockwise scales (see the module docstring for the layouts)."""
    (m, k), n = a_q.shape, b_q.shape[0]
    rows, cols = -(-m // ROW_ALIGN) * ROW_ALIGN, -(-k // K_ALIGN) * K_ALIGN
    a_q, a_scale = _padded(a_q, rows, cols), _padded(a_scale, rows, cols // TILE, 1.0)
    b_q, b_scale = _padded(b_q, n, cols), _padded(b_scale, b_scale.shape[0], cols // TILE, 1.0)
    scale_b = b_scale.t() if b_blocks else b_scale.t().contiguous()
    out = torch._scaled_mm(a_q, b_q.t(), scale_a=outer_dim_major(a_scale), scale_b=scale_b, out_dtype=BF16,
                           use_fast_accum=USE_FAST_ACCUM)
    return out if rows == m else out[:m]


def emulated_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, b_blocks: bool) -> Tensor:
    """The same product from dequantized operands: an fp32 GEMM, rounded to bf16 once."""
    a = quant.dequantize_tiles(a_q, a_scale)
    b = quant.dequantize_blocks(b_q, b_scale) if b_blocks else quant.dequantize_tiles(b_q, b_scale)
    return torch.mm(a, b.t()).to(BF16)


def mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, b_blocks: bool, kernel: str) -> Tensor:
    """bf16 [M, N] = A @ B.T for kernel "emulated" or "scaled_mm" (M or K = 0: zeros, no kernel launched)."""
    if a_q.shape[0] == 0 or a_q.shape[1] == 0:
        return a_q.new_zeros(a_q.shape[0], b_q.shape[0], dtype=BF16)
    gemm = scaled_mm_nt if kernel == "scaled_mm" else emulated_mm_nt
    return gemm(a_q, a_scale, b_q, b_scale, b_blocks)
