"""Argument checks shared by the MXFP8 ops; fake and real impls both run them, so errors surface at compile time."""

from __future__ import annotations

import torch

from .gemm_args import check_multiple
from .mxfp8_kernels import require_kernel

BLOCK_SIZE = 32  # MXFP8: one E8M0 scale per 32 e4m3 elements
SCALE_ROUNDINGS = ("rceil", "floor")


def check_scale_rounding(scale_rounding: str) -> None:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding={scale_rounding!r} is not one of {SCALE_ROUNDINGS} "
                         "(torchao ScaleCalculationMode RCEIL / FLOOR)")


def check_block_multiple(op: str, **dims: int) -> None:
    check_multiple(op, BLOCK_SIZE, "the MXFP8 scale block", **dims)


def check_strings(scale_rounding: str, kernel: str, device: torch.device) -> None:
    check_scale_rounding(scale_rounding)
    require_kernel(kernel, device)


def scale_mode(scale_rounding: str):
    """torchao ScaleCalculationMode for a scale_rounding name."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    return ScaleCalculationMode(scale_rounding)
