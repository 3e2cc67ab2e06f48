"""Argument checks shared by every low-precision GEMM op (MXFP8 and FP8-rowwise alike).

Fake and real implementations both run them, so a bad call fails at compile time with the fix in the message.
"""

from __future__ import annotations

import torch


def check_bf16(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.bfloat16:
            raise ValueError(f"{op}: {name} is {t.dtype}; moepass's FP8 GEMM ops take torch.bfloat16 only "
                             "(the pass only rewrites bf16 GEMMs: cast to bf16 or leave this GEMM unrewritten)")


def check_weight(op: str, **tensors: torch.Tensor | None) -> None:
    """A weight in bfloat16, or float32 (an FP32 master weight under autocast, quantized straight to FP8)."""
    for name, t in tensors.items():
        if t is not None and t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{op}: {name} is {t.dtype}; moepass's FP8 GEMM ops take a bf16 weight "
                             "(torch.bfloat16), or a float32 one (an FP32 master weight under autocast, quantized "
                             "straight from it)")


def check_multiple(op: str, multiple: int, why: str, **dims: int) -> None:
    for name, size in dims.items():
        if size % multiple != 0:
            raise ValueError(f"{op}: {name}={size} is not a multiple of {multiple} ({why}); "
                             f"pad {name} to a multiple of {multiple} or leave this GEMM in BF16")


def check_offs(op: str, offs: torch.Tensor, experts: int | None = None) -> None:
    """offs: int32 [E] cumulative group ends, E >= 1 (and E == experts when the weight is given)."""
    bad_e = experts is not None and offs.dim() == 1 and offs.shape[0] != experts
    if offs.dtype != torch.int32 or offs.dim() != 1 or offs.shape[0] == 0 or bad_e:
        want = f"E={experts}" if experts is not None else "E >= 1"
        raise ValueError(f"{op}: offs must be int32 [E] cumulative group ends with {want}, "
                         f"got {offs.dtype} {tuple(offs.shape)}")
