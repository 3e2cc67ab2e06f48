"""Blockwise FP8: DeepSeek-V3's training recipe. e4m3 everywhere, one FP32 scale per 1x128 tile of activations and
gradients (128 consecutive elements along the GEMM's reduction dim, per row) and per 128x128 block of weights.

scale = amax / 448 of its tile or block, not rounded to a power of two (as DeepSeek-V3 trains; MXFP8 and FP8 rowwise
round theirs). A weight's 128x128 block serves the forward (x @ W.T, W read along K) and the dgrad (grad_out @ W,
read along N) alike; the wgrad's operands are tiled along tokens (128x1 tiles down the token dim), tokens padded with
zero rows to a multiple of 128, each expert's token group on its own (tiles never straddle groups).

Kernels (ops/lowp/blockwise/kernels/choice.py chooses per device and GEMM kind): torch._scaled_mm with blockwise scales
on sm_90; grouped GEMMs one torch._scaled_mm per token group there, else moepass's Triton grouped kernels (self-checked
once; slower than the per-group loop where both run, as measured), or DeepGEMM (torchao 0.18's blockwise grouped op) on
request only (measured mostly slower than BF16 op by op, and failing in a 671B-dims step); "emulated" (the numerics
reference: dequantize, fp32 GEMM) on CPU; no kernel elsewhere (the GEMM stays BF16 with the reason). Opt-in
(`recipe="blockwise"`): recipe="auto" never picks it until measured. Its ops: moepass/ops/lowp/blockwise/. Kernel
"scaled_mm" ops are decomposed for Inductor into their quantization in plain torch (fused by Inductor) around the opaque
GEMM ops moepass::blockwise_scaled_mm and blockwise_scaled_grouped_mm (ops/lowp/blockwise/decomp.py); the compiled-graph
audit records those as moepass ops.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from moepass.option_types import OptionsError, option
from moepass.recipes.base import Recipe
from moepass.recipes.registry import register

from ..grouped_mm import define_grouped_mm_ops
from ..grouped_mm_rows import define_grouped_mm_rows_ops, rows_decompositions
from ..linear import define_linear_ops
from . import decomp, grouped_mm, linear, quant  # modules, read at each call: tests patch their functions
from .kernels import choice  # read at each call: tests patch its functions


@dataclasses.dataclass(frozen=True)
class BlockwiseOptions:
    kernel: Literal["auto", "emulated", "scaled_mm", "triton", "deepgemm"] = option(
        "auto", "blockwise FP8 kernels: auto = scaled_mm on sm_90, else Triton grouped GEMMs, emulated on CPU; "
        "deepgemm on request")
    wgrad_bf16: bool = option(
        False, "keep the weight-gradient GEMM in BF16 under the blockwise recipe (forward and dgrad stay FP8)")


class BlockwiseRecipe(Recipe):
    name = "blockwise"
    Options = BlockwiseOptions
    multiple = quant.TILE  # 1x128 tiles along K and N (and tokens, padded), 128x128 weight blocks
    multiple_why = "blockwise FP8 scales 1x128 tiles and 128x128 weight blocks"

    def choose_kernel(self, requested: str, device: torch.device | str, kind: str) -> tuple[str | None, str]:
        if requested not in ("auto", *choice.KERNELS):
            raise OptionsError(f"moepass: blockwise.kernel={requested!r} is not one of {['auto', *choice.KERNELS]}")
        grouped = kind == "grouped"
        if requested == "auto":
            return choice.choose_blockwise_kernel(device, grouped)
        if requested == "emulated":
            return "emulated", "blockwise.kernel='emulated' requested (dequantized operands, fp32 GEMM)"
        # DeepGEMM and the Triton kernels: grouped GEMMs only, linears on torch._scaled_mm
        kernel = "scaled_mm" if requested in ("deepgemm", "triton") and not grouped else requested
        problem = choice.kernel_problem(kernel, torch.device(device), grouped)
        if problem:
            raise OptionsError(f"moepass: blockwise.kernel={requested!r} requested but {problem}. "
                               "Use blockwise.kernel='auto' or 'emulated' on this device.")
        return kernel, f"blockwise.kernel={requested!r} requested ({kernel} for {kind} GEMMs)"

    def choose_wgrad_bf16(self, requested, kind: str) -> tuple[bool, str]:
        return requested, "wgrad BF16: blockwise.wgrad_bf16=True requested" if requested else ""

    def decompositions(self, config) -> dict:
        """Kernel "scaled_mm" ops become their quantization in plain torch around an opaque GEMM op, so Inductor
        fuses the quantization (decomp.py); no option changes the table."""
        decomp.register_inductor_fallbacks(self)
        return {**decomp.blockwise_decompositions(self), **rows_decompositions(self)}


BLOCKWISE = BlockwiseRecipe()
define_linear_ops(BLOCKWISE, linear.GEMMS)
define_grouped_mm_ops(BLOCKWISE, grouped_mm.GEMMS)
define_grouped_mm_rows_ops(BLOCKWISE, grouped_mm.GEMMS, grouped_mm.ROWS)
register(BLOCKWISE)
