"""MXFP8: e4m3 elements with one E8M0 scale per 32 along each GEMM's reduction dim (torchao's MX formats).

Native kernels on sm_100 (torchao), emulated elsewhere with the same numerics: the reference recipe, the one
moepass is tested with on CPU. Its ops: moepass/ops/lowp/mxfp8.py (emulated ops on CUDA decomposed for Inductor:
mxfp8_decomp.py).
"""

from __future__ import annotations

import torch

from moepass.options import OptionsError

from .base import Recipe


class MXFP8Recipe(Recipe):
    name = "mxfp8"
    ops_module = "moepass.ops.lowp.mxfp8"
    multiple = 32  # one E8M0 scale per 32 e4m3 elements along K, N (the dgrad's reduction) and tokens (padded)
    multiple_why = "the MXFP8 scale block"
    op_settings = ("str scale_rounding",)
    options = ("mxfp8.scale_rounding", "mxfp8.wgrad_bf16", "mxfp8.kernel")

    def settings(self, config) -> tuple:
        return (config["mxfp8.scale_rounding"],)

    def choose_kernel(self, requested: str, device: torch.device | str, kind: str) -> tuple[str, str]:
        from moepass.ops.lowp.mxfp8_kernels import choose_mxfp8_kernel

        best, why = choose_mxfp8_kernel(device)
        if requested == "auto":
            return best, why
        if requested == "emulated":
            return "emulated", f"mxfp8.kernel='emulated' requested ({why})"
        if best != "sm100":
            raise OptionsError(f"moepass: mxfp8.kernel='sm100' requested but {why}. "
                               "Use mxfp8.kernel='auto' or 'emulated' on this device.")
        return "sm100", why

    def decompositions(self, config) -> dict:
        """Kernel "emulated" ops on CUDA become plain torch, so Inductor fuses their quantization
        (ops/lowp/mxfp8_decomp.py); no option changes the table."""
        from moepass.ops.lowp.mxfp8_decomp import mxfp8_decompositions, register_inductor_fallbacks

        register_inductor_fallbacks()
        return mxfp8_decompositions()


MXFP8 = MXFP8Recipe()
