"""MXFP8: e4m3 elements with one E8M0 scale per 32 along each GEMM's reduction dim (torchao's MX formats).

Native kernels on sm_100 (torchao), emulated elsewhere with the same numerics: the reference recipe, the one
moepass is tested with on CPU. Its folder: linear.py and grouped_mm.py (the six GEMMs, which this module registers as
ops through the op families), quant.py (the MX quantization), kernels/choice.py (which implementation runs where),
decomp.py (emulated ops on CUDA decomposed for Inductor).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from moepass.option_types import OptionsError, option
from moepass.recipes.base import Recipe
from moepass.recipes.registry import register

from ..grouped_mm import define_grouped_mm_ops
from ..linear import define_linear_ops
from . import decomp, grouped_mm, linear, quant  # modules, read at each call: tests patch their functions
from .kernels import choice  # read at each call: tests patch its functions


@dataclasses.dataclass(frozen=True)
class MXFP8Options:
    kernel: Literal["auto", "emulated", "sm100"] = option(
        "auto", "MXFP8 kernels: auto picks native on sm_100, emulated elsewhere")
    wgrad_bf16: bool = option(False, "keep the weight-gradient GEMM in BF16 (dgrad and forward stay MXFP8)")
    scale_rounding: Literal["rceil", "floor"] = option("rceil", "E8M0 scale rounding of the MXFP8 recipe")


class MXFP8Recipe(Recipe):
    name = "mxfp8"
    Options = MXFP8Options
    multiple = quant.BLOCK  # one E8M0 scale per 32 e4m3 elements along K, N (the dgrad's reduction) and tokens
    multiple_why = "the MXFP8 scale block"
    op_settings = ("str scale_rounding",)

    def settings(self, config) -> tuple:
        return (self.read(config).scale_rounding,)

    def choose_kernel(self, requested: str, device: torch.device | str, kind: str) -> tuple[str, str]:
        best, why = choice.choose_mxfp8_kernel(device)
        if requested == "auto":
            return best, why
        if requested == "emulated":
            return "emulated", f"mxfp8.kernel='emulated' requested ({why})"
        if best != "sm100":
            raise OptionsError(f"moepass: mxfp8.kernel='sm100' requested but {why}. "
                               "Use mxfp8.kernel='auto' or 'emulated' on this device.")
        return "sm100", why

    def decompositions(self, config) -> dict:
        """Kernel "emulated" ops on CUDA become plain torch, so Inductor fuses their quantization (decomp.py); no
        option changes the table."""
        decomp.register_inductor_fallbacks(self)
        return decomp.mxfp8_decompositions(self)


MXFP8 = MXFP8Recipe()
define_linear_ops(MXFP8, linear.GEMMS)
define_grouped_mm_ops(MXFP8, grouped_mm.GEMMS)
register(MXFP8)
