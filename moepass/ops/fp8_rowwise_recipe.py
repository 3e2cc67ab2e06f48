"""The FP8-rowwise recipe as the op families see it: no settings of its own, its kernels, 16-byte-aligned K and N."""

from __future__ import annotations

import torch

from .formats import FP8_ALIGN
from .fp8_rowwise_kernels import require_kernel
from .op_recipe import OpRecipe


def _check_settings(device: torch.device, grouped: bool, kernel: str) -> None:
    require_kernel(kernel, device, grouped=grouped)


FP8_ROWWISE = OpRecipe("fp8_rowwise", settings=(), multiple=FP8_ALIGN,
                       multiple_why="FP8 GEMMs read 16-byte rows", check_settings=_check_settings)
