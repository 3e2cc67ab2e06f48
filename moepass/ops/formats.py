"""Low-precision format constants, written once: the element type, the MXFP8 scale block, the FP8 GEMM alignment."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MX_BLOCK = 32  # MXFP8: one E8M0 scale per 32 e4m3 elements along the reduction dim
FP8_ALIGN = 16  # torch._scaled_mm / _scaled_grouped_mm: K and N multiples of 16 (16-byte rows of e4m3)
