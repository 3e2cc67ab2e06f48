"""The blockwise ops' "scaled_mm" and "triton" kernels handed to Inductor as plain torch around opaque GEMM ops.

Inside the opaque moepass::blockwise_* ops the 1x128 / 128x128 quantization ran as eager torch, one kernel per reshape,
amax, divide, clamp and cast (several times the GEMMs' time: docs/recipes.md has the figures). Decomposed by
AOTAutograd, each op becomes the code its own body runs for kernel "scaled_mm" (linear.py, grouped_mm.py:
quant.quantize_tiles / quantize_blocks on the operands as the GEMM reads them, the wgrad's token padding included, then
kernels/gemm.py's mm_nt / grouped_mm_nt), which Inductor fuses into a reduction kernel per operand (into the operand's
producer where it can), leaving moepass::blockwise_scaled_mm and blockwise_scaled_grouped_mm (kernel "triton":
blockwise_triton_grouped_mm) opaque: they take quantized operands and scales and run torch._scaled_mm (kernels/gemm.py
keeps the scale layouts and the K / row padding cuBLASLt needs). They must stay opaque: Inductor's _scaled_mm lowering
refuses blockwise scales once shapes are symbolic. Same code eager and compiled, so the same numbers (scales are amax *
fp32(1/448): see quant.py).

Kernels "emulated" and "deepgemm" are not decomposed (the reference stays one op; DeepGEMM brings its own Triton
quantizers). Zero tokens need no care here: every amax runs over a whole 128-wide tile, never over the tokens.
"""

from __future__ import annotations

import functools

import torch

from ..inductor_fallbacks import decomposition, gemm_decompositions, register_fallbacks
from . import grouped_mm, linear, quant


DECOMPOSED = ("scaled_mm", "triton")  # the kernels whose GEMMs are opaque ops on quantized operands


def _decomposed(args: tuple) -> bool:
    return args[-1] in DECOMPOSED  # the ops' last argument: their kernel


def blockwise_decompositions(recipe) -> dict:
    """{OpOverload: decomposition} of `recipe`'s (blockwise's) ops for compile_fx(..., decompositions=...), merged over
    Inductor's own table."""
    ops = torch.ops.moepass
    return {
        ops.blockwise_quantize_rows.default: decomposition(lambda x, kernel: quant.quantize_tiles(x), _decomposed),
        ops.blockwise_grouped_mm_on_rows.default: decomposition(grouped_mm.forward_rows, _decomposed),
        **gemm_decompositions(recipe, {
            "linear": linear.forward, "linear_dgrad": linear.dgrad, "linear_wgrad": linear.wgrad,
            "grouped_mm": grouped_mm.forward, "grouped_mm_dgrad": grouped_mm.dgrad,
            "grouped_mm_wgrad": grouped_mm.wgrad}, _decomposed),
    }


@functools.lru_cache(maxsize=None)
def register_inductor_fallbacks(recipe) -> None:
    """Lowerings for the ops a decomposition declines (kernels "emulated", "deepgemm")."""
    register_fallbacks(blockwise_decompositions(recipe))
