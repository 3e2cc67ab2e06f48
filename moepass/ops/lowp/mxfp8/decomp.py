"""Emulated MXFP8 on a GPU without sm_100, handed to Inductor as plain torch so it fuses the quantization.

Kernel "emulated" quantizes each operand with torchao's to_mx, dequantizes it (exactly: e4m3 times a power of two)
and runs a BF16 GEMM. Inside the opaque op that is eager torch, a dozen elementwise kernels per operand over fp32
copies, the expert weights quantized again in every forward and dgrad: several times BF16's step, which priced
MXFP8's numerics over seeds out of a device job (examples/results/numerics_seeds_16B_l2_h200/).
Decomposed by AOTAutograd, each op becomes the code its own body runs (linear.py: quant.dequantized_rows around
torch.mm; grouped_mm.py: torchao's emulated grouped path around torch._grouped_mm, our token-group padding included),
and Inductor fuses each operand's quantize-dequantize into one kernel (into its producer where it can). Same code eager
and compiled, so the same bits (tests/gpu/test_mxfp8_ops_gpu.py checks the backend against the eager ops).

Only on CUDA tensors: on CPU (the test suite's device) the decomposition declines and the op stays one opaque call,
since Inductor's C++ for the fused quantization costs more compile time than the eager op costs at CPU sizes. The
sm100 kernel is never decomposed (torchao's own CUDA casts and MX GEMMs). In compiled graphs a decomposed op shows
as its BF16 GEMM (aten.mm / aten._grouped_mm), which is what emulation runs.
"""

from __future__ import annotations

import functools

from ..inductor_fallbacks import gemm_decompositions, register_fallbacks
from . import grouped_mm, linear

FUSED_ON = ("cuda",)  # device types whose emulated ops are decomposed (a test adds "cpu")


def _fused(args: tuple) -> bool:
    """Kernel "emulated" (the ops' last argument) on a device in FUSED_ON (read at each call: a test extends it)."""
    return args[-1] == "emulated" and args[0].device.type in FUSED_ON


def mxfp8_decompositions(recipe) -> dict:
    """{OpOverload: decomposition} of `recipe`'s (MXFP8's) ops for compile_fx(..., decompositions=...), merged over
    Inductor's own table."""
    return gemm_decompositions(recipe, {
        "linear": linear.forward, "linear_dgrad": linear.dgrad, "linear_wgrad": linear.wgrad,
        "grouped_mm": grouped_mm.forward, "grouped_mm_dgrad": grouped_mm.dgrad, "grouped_mm_wgrad": grouped_mm.wgrad},
        _fused)


@functools.lru_cache(maxsize=None)
def register_inductor_fallbacks(recipe) -> None:
    """Lowerings for the ops whose decomposition declines (CPU tensors, kernel "sm100")."""
    register_fallbacks(mxfp8_decompositions(recipe))
