"""Blockwise e4m3 quantization in plain torch (Inductor compiles it as it is): 1x128 tiles and 128x128 blocks.

scale = amax / 448 of each tile or block (fp32, floored at AMAX_EPS / 448 so an all-zero tile gets zero data), not
rounded to a power of two, as DeepSeek-V3 trains; q = e4m3(clamp(t / scale, -448, 448)), so each tile's largest
magnitude maps to 448. The scale is computed as amax * fp32(1 / 448) (within an ulp of amax / 448): Inductor's Triton
code turns a division by a constant into that product, so eager torch, Inductor's CPU code and its Triton code all
give the same scales (the decompositions of decomp.py are compared with the eager ops bit for bit). Scales are
dequantization factors (t ~= q * scale), torch._scaled_mm's convention.

Every function takes the operand as the GEMM reads it, reduction dim last ([rows, K]): the caller transposes first
where the reduction runs down the columns (the wgrad's tokens, the dgrad's N).
"""

from __future__ import annotations

from torch import Tensor

from ..formats import E4M3, E4M3_MAX

TILE = 128  # 1x128 tiles (activations, gradients) and 128x128 blocks (weights): the recipe's `multiple`
AMAX_EPS = 1e-12  # torchao's and DeepSeek's floor on amax


def _scale(amax: Tensor) -> Tensor:
    return amax.float().clamp(min=AMAX_EPS) * (1 / E4M3_MAX)


def _cast(scaled: Tensor) -> Tensor:
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_tiles(t: Tensor) -> tuple[Tensor, Tensor]:
    """[R, C] -> q [R, C] e4m3 (contiguous), scale [R, C / 128] fp32: one scale per 128 consecutive elements of a
    row."""
    r, c = t.shape
    tiles = t.reshape(r, c // TILE, TILE).float()
    scale = _scale(tiles.abs().amax(dim=-1))
    return _cast(tiles / scale.unsqueeze(-1)).reshape(r, c), scale


def quantize_blocks(t: Tensor) -> tuple[Tensor, Tensor]:
    """[..., R, C] -> q [..., R, C] e4m3 (contiguous), scale [..., R / 128, C / 128] fp32: one scale per 128x128 block
    (its transpose's blocks are the same blocks: quantize_blocks(t.mT) gives q.mT and scale.mT)."""
    *lead, r, c = t.shape
    blocks = t.reshape(*lead, r // TILE, TILE, c // TILE, TILE).float()
    scale = _scale(blocks.abs().amax(dim=(-3, -1)))
    return _cast(blocks / scale[..., :, None, :, None]).reshape(*lead, r, c), scale


def dequantize_tiles(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 [R, C] from quantize_tiles' output."""
    r, c = q.shape
    return (q.float().reshape(r, c // TILE, TILE) * scale.unsqueeze(-1)).reshape(r, c)


def dequantize_blocks(q: Tensor, scale: Tensor) -> Tensor:
    """fp32 [..., R, C] from quantize_blocks' output."""
    *lead, r, c = q.shape
    blocks = q.float().reshape(*lead, r // TILE, TILE, c // TILE, TILE) * scale[..., :, None, :, None]
    return blocks.reshape(*lead, r, c)
