"""Eligibility rules shared by the two low-precision GEMM passes (linear and grouped_mm).

Each rule returns None when a GEMM may be rewritten, else a reason a user can act on.
"""

from __future__ import annotations

import torch

from .graph import matches_any
from .ops.formats import MX_BLOCK
from .options import Config, OptionsError


def module_filter_problem(path: str, config: Config) -> str | None:
    hit = matches_any(path, config["lowp.exclude"])
    if hit is not None:
        return f"excluded by lowp.exclude pattern {hit!r}"
    if matches_any(path, config["lowp.include"]) is None:
        return f"module path {path!r} matches no lowp.include pattern {list(config['lowp.include'])}"
    return None


def dtype_problem(**tensors: torch.Tensor | None) -> str | None:
    for name, t in tensors.items():
        if t is None:
            return f"{name} has no recorded tensor metadata"
        if t.dtype != torch.bfloat16:
            return f"{name} is {t.dtype}, not bfloat16 (the low-precision GEMM passes rewrite BF16 GEMMs only)"
    return None


def shape_problem(k: int, n: int, multiple: int = MX_BLOCK) -> str | None:
    """None when K and N are positive multiples of `multiple` (the kernels' alignment), else what is off."""
    if k == 0 or n == 0:  # 0 is a multiple of anything, but there is nothing to quantize (a zero-width expert)
        return f"empty GEMM (K={k}, N={n}): nothing to quantize"
    bad = [f"{name}={v} not a multiple of {multiple}" for name, v in (("K", k), ("N", n))
           if not isinstance(v, int) or v % multiple]
    return ", ".join(bad) if bad else None


def choose_kernel(config: Config, device: torch.device) -> tuple[str, str]:
    """(kernel, reason) for the MXFP8 ops on `device`, honouring the `mxfp8.kernel` option."""
    from moepass.ops.mxfp8_kernels import choose_mxfp8_kernel

    best, why = choose_mxfp8_kernel(device)
    requested = config["mxfp8.kernel"]
    if requested == "auto":
        return best, why
    if requested == "emulated":
        return "emulated", f"mxfp8.kernel='emulated' requested ({why})"
    if best != "sm100":
        raise OptionsError(f"moepass: mxfp8.kernel='sm100' requested but {why}. "
                           "Use mxfp8.kernel='auto' or 'emulated' on this device.")
    return "sm100", why
