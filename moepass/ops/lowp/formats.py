"""Low-precision format constants: the element type, and each recipe's block as its object states it."""

from __future__ import annotations

import torch

from moepass.recipes.blockwise import BLOCKWISE
from moepass.recipes.fp8_rowwise import FP8_ROWWISE
from moepass.recipes.mxfp8 import MXFP8

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MX_BLOCK = MXFP8.multiple  # MXFP8: one E8M0 scale per 32 e4m3 elements along the reduction dim
FP8_ALIGN = FP8_ROWWISE.multiple  # torch._scaled_mm / _scaled_grouped_mm: K and N multiples of 16 (16-byte rows)
BLOCKWISE_TILE = BLOCKWISE.multiple  # blockwise: 1x128 tiles (activations, gradients) and 128x128 blocks (weights)
