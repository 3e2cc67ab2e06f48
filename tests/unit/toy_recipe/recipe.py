"""bf16_roundtrip: a toy recipe whose GEMMs are plain matmuls, declared the way moepass's own recipes are.

Its options (bf16_roundtrip.kernel, .wgrad_bf16, .accumulate) come from its Options; `accumulate` reaches every op as
its own argument (op_settings). Importing this module registers moepass::bf16_roundtrip_linear, _grouped_mm and their
_dgrad / _wgrad from the GEMMs of linear.py and grouped_mm.py; moepass.recipes.registry.register(BF16_ROUNDTRIP) makes
the `recipe` option offer it (a recipe from outside moepass joins with that one call: the test makes it).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from moepass.ops.lowp.grouped_mm import define_grouped_mm_ops
from moepass.ops.lowp.linear import define_linear_ops
from moepass.option_types import option
from moepass.recipes.base import Recipe

from . import decomp, grouped_mm, linear
from .kernels import choice


@dataclasses.dataclass(frozen=True)
class RoundtripOptions:
    kernel: Literal["auto", "reference"] = option("auto", "the toy recipe's kernels: plain torch matmuls anywhere")
    wgrad_bf16: bool = option(False, "the weight gradient on moepass's BF16 op instead of the toy's own")
    accumulate: Literal["bf16", "fp32"] = option("bf16", "accumulate each GEMM in BF16, or in FP32 rounded once")


class RoundtripRecipe(Recipe):
    name = "bf16_roundtrip"
    Options = RoundtripOptions
    multiple = 8
    multiple_why = "the toy recipe's block"
    op_settings = ("str accumulate",)

    def settings(self, config) -> tuple:
        return (self.read(config).accumulate,)

    def choose_kernel(self, requested, device, kind):
        return choice.choose_kernel(requested, self.kernel_option)

    def decompositions(self, config) -> dict:
        return decomp.roundtrip_decompositions()


BF16_ROUNDTRIP = RoundtripRecipe()
define_linear_ops(BF16_ROUNDTRIP, linear.GEMMS)
define_grouped_mm_ops(BF16_ROUNDTRIP, grouped_mm.GEMMS)
