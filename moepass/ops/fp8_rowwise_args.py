"""Argument checks shared by the FP8-rowwise ops; fake and real impls both run them, so errors show at compile time."""

from __future__ import annotations

import torch

from .fp8_rowwise_kernels import require_kernel

ALIGN = 16  # torch._scaled_mm / _scaled_grouped_mm: K and N multiples of 16 (16-byte rows of e4m3)


def check_bf16(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.bfloat16:
            raise ValueError(f"{op}: {name} is {t.dtype}; FP8-rowwise ops take torch.bfloat16 only "
                             "(the pass only rewrites bf16 GEMMs: cast to bf16 or leave this GEMM unrewritten)")


def check_aligned(op: str, **dims: int) -> None:
    for name, size in dims.items():
        if size % ALIGN != 0:
            raise ValueError(f"{op}: {name}={size} is not a multiple of {ALIGN} (FP8 GEMMs read 16-byte rows); "
                             f"pad {name} to a multiple of {ALIGN} or leave this GEMM in BF16")


def check_kernel(kernel: str, device: torch.device, grouped: bool) -> None:
    require_kernel(kernel, device, grouped)


def check_offs(op: str, offs: torch.Tensor, experts: int | None = None) -> None:
    """offs: int32 [E] cumulative group ends, E >= 1 (and E == experts when the weight is given)."""
    bad_e = experts is not None and offs.dim() == 1 and offs.shape[0] != experts
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] == 0 or bad_e:
        want = f"E={experts}" if experts is not None else "E >= 1"
        raise ValueError(f"{op}: offs must be int32 [E] cumulative group ends with {want}, "
                         f"got {offs.dtype} {tuple(offs.shape)}")
