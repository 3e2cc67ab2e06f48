"""FP8 rowwise: e4m3 with one power-of-two scale per row (or column) of each operand, Hopper's native FP8 recipe.

torch._scaled_mm (sm_89+) and torch._scaled_grouped_mm (sm_90) on FP8 tensor cores (kernel "scaled_mm"), emulated
elsewhere with the same numerics. Kernel "scaled_mm" ops are decomposed into plain torch for Inductor, which fuses
their quantization into the operands' producers; three options change that table. Its ops:
moepass/ops/lowp/fp8_rowwise/.
"""

from __future__ import annotations

import torch

from moepass.options import OptionsError

from .auto import THRESHOLDS_SOURCE, WGRAD_BF16_AUTO
from .base import Recipe


class FP8RowwiseRecipe(Recipe):
    name = "fp8_rowwise"
    ops_module = "moepass.ops.lowp.fp8_rowwise"
    multiple = 16  # torch._scaled_mm / _scaled_grouped_mm: K and N multiples of 16 (16-byte rows of e4m3)
    multiple_why = "FP8 GEMMs read 16-byte rows"
    decomposition_options = ("fp8_rowwise.expert_weights_once", "fp8_rowwise.linear_both_layouts",
                             "fp8_rowwise.linear_weights_once")
    options = ("fp8_rowwise.kernel", "fp8_rowwise.wgrad_bf16", *decomposition_options)
    decomposed_gemms = ("_scaled_mm", "_scaled_grouped_mm")

    def choose_kernel(self, requested: str, device: torch.device | str, kind: str) -> tuple[str, str]:
        from moepass.ops.lowp.fp8_rowwise.kernels import KERNELS, choose_fp8_rowwise_kernel

        if requested not in ("auto", *KERNELS):
            raise OptionsError(f"moepass: fp8_rowwise.kernel={requested!r} is not one of {['auto', *KERNELS]}")
        best, why = choose_fp8_rowwise_kernel(device, kind == "grouped")
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
        values = {}
        if config["fp8_rowwise.linear_both_layouts"] == "auto":
            fp8_wgrad = not self.wgrad_bf16(config, "linear")[0]
            values["fp8_rowwise.linear_both_layouts"] = "grads_and_inputs" if fp8_wgrad else "none"
        for key in ("fp8_rowwise.expert_weights_once", "fp8_rowwise.linear_weights_once"):
            if config[key] == "auto":
                values[key] = not weights_sharded
        return config.with_values(**values) if values else config

    def decompositions(self, config) -> dict:
        """Kernel "scaled_mm" ops become plain torch, so Inductor fuses their quantization (ops/lowp/fp8_rowwise/
        decomp.py); the fp8_rowwise.* layout options pick which quantizations are shared."""
        from moepass.ops.lowp.fp8_rowwise.decomp import fp8_rowwise_decompositions, register_inductor_fallbacks

        from moepass.ops.lowp.grouped_mm_rows import rows_decompositions

        register_inductor_fallbacks()
        return {**fp8_rowwise_decompositions(config["fp8_rowwise.expert_weights_once"],
                                             config["fp8_rowwise.linear_both_layouts"],
                                             config["fp8_rowwise.linear_weights_once"]),
                **rows_decompositions(self)}


FP8_ROWWISE = FP8RowwiseRecipe()
