"""The FP8 element type every recipe quantizes to (each recipe's block is its own: Recipe.multiple)."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
