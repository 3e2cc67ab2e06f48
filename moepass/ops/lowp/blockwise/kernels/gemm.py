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
Kernel "scaled_mm" runs through the opaque ops moepass::blockwise_scaled_mm and blockwise_scaled_grouped_mm (quantized
operands in, bf16 out; one GEMM per token group for the grouped one), which the decompositions of decomp.py leave in
compiled graphs; on CPU their body is the emulated GEMM (tests compare compiled graphs with "emulated" bit for bit).
Kernel "triton" is kernel "scaled_mm" with its grouped GEMMs in moepass::blockwise_triton_grouped_mm instead (every
token group in one Triton launch: triton_grouped.py); its linears are kernel "scaled_mm"'s.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import quant

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


def _mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, b_blocks: bool, kernel: str) -> Tensor:
    if a_q.shape[0] == 0 or a_q.shape[1] == 0:  # M or K = 0: zeros, no kernel launched
        return a_q.new_zeros(a_q.shape[0], b_q.shape[0], dtype=BF16)
    gemm = scaled_mm_nt if kernel == "scaled_mm" else emulated_mm_nt
    return gemm(a_q, a_scale, b_q, b_scale, b_blocks)


def _groups(ends: Tensor) -> list[tuple[int, int, int]]:
    """(expert, start, end) of every non-empty group, from int group ends (a host sync)."""
    bounds = ends.tolist()
    return [(g, start, end) for g, (start, end) in enumerate(zip([0, *bounds[:-1]], bounds)) if end > start]


def _grouped_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """One _mm_nt per token group (group bounds read on the host). Two forms:
    b_q [E, N, K] in 128x128 blocks (scale [E, N/128, K/128]), a_q [M, K] tokens in 1x128 tiles: out [M, N],
        rows a_q[start:end] of group g times b_q[g]; rows at or after offs[-1] zero (the forward and the dgrad);
    b_q [K, P] in 1x128 tiles along P (scale [K, P/128]), a_q [N, P] likewise, P tokens in groups ending at offs,
        each a multiple of 128: out [E, N, K], group g's columns of a_q times its columns of b_q (the wgrad)."""
    if b_q.dim() == 3:
        out = a_q.new_zeros(a_q.shape[0], b_q.shape[1], dtype=BF16)
        for g, start, end in _groups(offs):
            out[start:end] = _mm_nt(a_q[start:end], a_scale[start:end], b_q[g], b_scale[g], True, kernel)
        return out
    out = a_q.new_zeros(offs.shape[0], a_q.shape[0], b_q.shape[0], dtype=BF16)
    for g, start, end in _groups(offs):
        tiles = slice(start // TILE, end // TILE)
        out[g] = _mm_nt(a_q[:, start:end], a_scale[:, tiles], b_q[:, start:end], b_scale[:, tiles], False, kernel)
    return out


# ---- the GEMMs as opaque ops: Inductor fuses the quantization around them (decomp.py), never sees inside ------
# Kernel "scaled_mm" reaches them alone. Their CPU body is the emulated GEMM (kernel "scaled_mm" never runs on CPU
# outside tests, where it lets compiled graphs be compared bit for bit with kernel "emulated").

def _device_kernel(t: Tensor) -> str:
    return "scaled_mm" if t.device.type == "cuda" else "emulated"


@torch.library.custom_op("moepass::blockwise_scaled_mm", mutates_args=())
def blockwise_scaled_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, b_blocks: bool) -> Tensor:
    """bf16 [M, N] = A @ B.T from quantized operands: a_q [M, K] e4m3 in 1x128 tiles (a_scale [M, K/128] fp32),
    b_q [N, K] in 128x128 blocks (b_blocks; b_scale [N/128, K/128]) or 1x128 tiles (b_scale [N, K/128])."""
    return _mm_nt(a_q, a_scale, b_q, b_scale, b_blocks, _device_kernel(a_q))


@blockwise_scaled_mm.register_fake
def _(a_q, a_scale, b_q, b_scale, b_blocks):
    return a_q.new_empty(a_q.shape[0], b_q.shape[0], dtype=BF16)


@torch.library.custom_op("moepass::blockwise_scaled_grouped_mm", mutates_args=())
def blockwise_scaled_grouped_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, offs: Tensor) -> Tensor:
    """The grouped GEMMs from quantized operands (_grouped_mm_nt's two forms: 3-D b_q per expert, 2-D by tokens)."""
    return _grouped_mm_nt(a_q, a_scale, b_q, b_scale, offs, _device_kernel(a_q))


def _grouped_mm_fake(a_q, a_scale, b_q, b_scale, offs):
    if b_q.dim() == 3:
        return a_q.new_empty(a_q.shape[0], b_q.shape[1], dtype=BF16)
    return a_q.new_empty(offs.shape[0], a_q.shape[0], b_q.shape[0], dtype=BF16)


blockwise_scaled_grouped_mm.register_fake(_grouped_mm_fake)


@torch.library.custom_op("moepass::blockwise_triton_grouped_mm", mutates_args=())
def blockwise_triton_grouped_mm(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, offs: Tensor) -> Tensor:
    """The grouped GEMMs of blockwise_scaled_grouped_mm in one Triton launch each, no host sync (triton_grouped.py;
    kernel "triton"); emulated on CPU, like the op above."""
    if a_q.device.type != "cuda":
        return _grouped_mm_nt(a_q, a_scale, b_q, b_scale, offs, "emulated")
    from . import triton_grouped  # needs triton, which a CPU-only torch does not bring

    return triton_grouped.grouped_mm_nt(a_q, a_scale, b_q, b_scale, offs)


blockwise_triton_grouped_mm.register_fake(_grouped_mm_fake)


def mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, b_blocks: bool, kernel: str) -> Tensor:
    """bf16 [M, N] = A @ B.T for kernel "emulated" or "scaled_mm" (the latter through moepass::blockwise_scaled_mm;
    M or K = 0: zeros, no kernel launched)."""
    if kernel == "scaled_mm":
        return torch.ops.moepass.blockwise_scaled_mm(a_q, a_scale, b_q, b_scale, b_blocks)
    return _mm_nt(a_q, a_scale, b_q, b_scale, b_blocks, kernel)


def grouped_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, offs: Tensor, kernel: str) -> Tensor:
    """_grouped_mm_nt for kernel "emulated", "scaled_mm" (through moepass::blockwise_scaled_grouped_mm: one
    torch._scaled_mm per token group) or "triton" (moepass::blockwise_triton_grouped_mm: one launch)."""
    if kernel == "scaled_mm":
        return torch.ops.moepass.blockwise_scaled_grouped_mm(a_q, a_scale, b_q, b_scale, offs)
    if kernel == "triton":
        return torch.ops.moepass.blockwise_triton_grouped_mm(a_q, a_scale, b_q, b_scale, offs)
    return _grouped_mm_nt(a_q, a_scale, b_q, b_scale, offs, kernel)
