"""Argument checks shared by the FP8-rowwise ops; fake and real impls both run them, so errors show at compile time."""

from __future__ import annotations

from .gemm_args import check_multiple

ALIGN = 16  # torch._scaled_mm / _scaled_grouped_mm: K and N multiples of 16 (16-byte rows of e4m3)


def check_aligned(op: str, **dims: int) -> None:
    check_multiple(op, ALIGN, "FP8 GEMMs read 16-byte rows", **dims)
