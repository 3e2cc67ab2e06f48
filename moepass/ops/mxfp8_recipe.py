"""The MXFP8 recipe as the op families see it: its scale-rounding setting, its kernels and its 32-element block."""

from __future__ import annotations

import torch

from .formats import MX_BLOCK
from .mxfp8_kernels import require_kernel
from .op_recipe import OpRecipe

SCALE_ROUNDINGS = ("rceil", "floor")


def check_scale_rounding(scale_rounding: str) -> None:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding={scale_rounding!r} is not one of {SCALE_ROUNDINGS} "
                         "(torchao ScaleCalculationMode RCEIL / FLOOR)")


def _check_settings(device: torch.device, grouped: bool, scale_rounding: str, kernel: str) -> None:
    check_scale_rounding(scale_rounding)
    require_kernel(kernel, device)


def scale_mode(scale_rounding: str):
    """torchao ScaleCalculationMode for a scale_rounding name."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    return ScaleCalculationMode(scale_rounding)


MXFP8 = OpRecipe("mxfp8", settings=("str scale_rounding",), multiple=MX_BLOCK,
                 multiple_why="the MXFP8 scale block", check_settings=_check_settings)
