"""FP8 rowwise: e4m3 with one power-of-two scale per row (or column) of each operand, Hopper's native FP8 recipe.

torch._scaled_mm (sm_89+) and torch._scaled_grouped_mm (sm_90) on FP8 tensor cores (kernel "scaled_mm"), emulated
elsewhere with the same numerics. Kernel "scaled_mm" ops are decomposed into plain torch for Inductor, which fuses
their quantization into the operands' producers; three options change that table. Its GEMMs (linear.py,
grouped_mm.py) are registered as ops here through the op families; the rest of the folder (quant.py, kernels/,
decomp.py): moepass/ops/lowp/fp8_rowwise/__init__.py.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from moepass.option_types import OptionsError, option
from moepass.recipes.auto import THRESHOLDS_SOURCE, WGRAD_BF16_AUTO
from moepass.recipes.base import Recipe
from moepass.recipes.registry import register

from ..grouped_mm import define_grouped_mm_ops
from ..grouped_mm_rows import define_grouped_mm_rows_ops, rows_decompositions
from ..linear import define_linear_ops
from . import decomp, grouped_mm, linear, quant  # modules, read at each call: tests patch their functions
from .kernels import both_layouts, token_group_cols  # noqa: F401  (register the quantization ops decomp calls)
from .kernels import choice  # read at each call: tests patch its functions

_AUTO_BOOL = Literal["auto", True, False]


@dataclasses.dataclass(frozen=True)
class FP8RowwiseOptions:
    kernel: Literal["auto", "emulated", "scaled_mm"] = option(
        "auto", "FP8-rowwise kernels: auto picks torch._scaled_mm (sm_89+), _scaled_grouped_mm (sm_90), else emulated")
    wgrad_bf16: _AUTO_BOOL = option(
        "auto", "keep the weight-gradient GEMM in BF16 under fp8_rowwise; auto: per GEMM kind (auto.WGRAD_BF16_AUTO)")
    expert_weights_once: _AUTO_BOOL = option(
        "auto", "quantize each expert weight once per step into both FP8 layouts; auto: on unless FSDP2 shards weights")
    linear_both_layouts: Literal["auto", "none", "grads", "grads_and_inputs"] = option(
        "auto", "quantize a linear's grads (and inputs) once into both FP8 layouts; auto: both when its wgrad is FP8")
    linear_weights_once: _AUTO_BOOL = option(
        "auto", "quantize each linear weight once per step into both FP8 layouts; auto: on unless FSDP2 shards weights")


class FP8RowwiseRecipe(Recipe):
    name = "fp8_rowwise"
    Options = FP8RowwiseOptions
    multiple = quant.ALIGN  # torch._scaled_mm / _scaled_grouped_mm: K and N multiples of 16 (16-byte rows of e4m3)
    multiple_why = "FP8 GEMMs read 16-byte rows"
    decomposition_options = ("fp8_rowwise.expert_weights_once", "fp8_rowwise.linear_both_layouts",
                             "fp8_rowwise.linear_weights_once")
    decomposed_gemms = ("_scaled_mm", "_scaled_grouped_mm")

    def check_options(self, options: FP8RowwiseOptions) -> None:
        if options.linear_both_layouts not in ("none", "auto") and options.wgrad_bf16 is True:
            raise OptionsError("moepass: option 'fp8_rowwise.linear_both_layouts'="
                               f"{options.linear_both_layouts!r} quantizes for the FP8 wgrad, which "
                               "'fp8_rowwise.wgrad_bf16'=True turns off; set one of them back to its default")

    def choose_kernel(self, requested: str, device: torch.device | str, kind: str) -> tuple[str, str]:
        if requested not in ("auto", *choice.KERNELS):
            raise OptionsError(f"moepass: fp8_rowwise.kernel={requested!r} is not one of "
                               f"{['auto', *choice.KERNELS]}")
        best, why = choice.choose_fp8_rowwise_kernel(device, kind == "grouped")
        if requested == "auto" or requested == best:
            return best, why
        if requested == "emulated":
            return "emulated", f"fp8_rowwise.kernel='emulated' requested ({why})"
        raise OptionsError(f"moepass: fp8_rowwise.kernel='scaled_mm' requested but {why}. "
                           "Use fp8_rowwise.kernel='auto' or 'emulated' on this device.")

    def choose_wgrad_bf16(self, requested, kind: str) -> tuple[bool, str]:
        if requested != "auto":
            which = "BF16" if requested else "FP8"
            return bool(requested), f"wgrad {which}: fp8_rowwise.wgrad_bf16={requested} requested"
        if WGRAD_BF16_AUTO[kind]:
            return True, ("wgrad BF16: its per-token-group quantization cost more than the FP8 GEMM saved "
                          f"({THRESHOLDS_SOURCE})")
        return False, "wgrad FP8"

    def settle(self, config, weights_sharded: bool):
        """linear_both_layouts auto: both operands of the FP8 wgrad (none when the linears' wgrad is BF16);
        *_weights_once auto: on, unless FSDP2 reshards the weights (a saved FP8 copy would outlive the reshard)."""
        options, values = self.read(config), {}
        if options.linear_both_layouts == "auto":
            fp8_wgrad = not self.choose_wgrad_bf16(options.wgrad_bf16, "linear")[0]
            values["fp8_rowwise.linear_both_layouts"] = "grads_and_inputs" if fp8_wgrad else "none"
        for name in ("expert_weights_once", "linear_weights_once"):
            if getattr(options, name) == "auto":
                values[f"fp8_rowwise.{name}"] = not weights_sharded
        return config.with_values(**values) if values else config

    def decompositions(self, config) -> dict:
        """Kernel "scaled_mm" ops become plain torch, so Inductor fuses their quantization (decomp.py); the
        fp8_rowwise.* layout options pick which quantizations are shared."""
        options = self.read(config)
        decomp.register_inductor_fallbacks()
        return {**decomp.fp8_rowwise_decompositions(options.expert_weights_once, options.linear_both_layouts,
                                                    options.linear_weights_once),
                **rows_decompositions(self)}


FP8_ROWWISE = FP8RowwiseRecipe()
define_linear_ops(FP8_ROWWISE, linear.GEMMS)
define_grouped_mm_ops(FP8_ROWWISE, grouped_mm.GEMMS)
define_grouped_mm_rows_ops(FP8_ROWWISE, grouped_mm.GEMMS, grouped_mm.ROWS)
register(FP8_ROWWISE)
