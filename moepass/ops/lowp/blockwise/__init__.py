"""The blockwise FP8 recipe (DeepSeek-V3's 1x128 / 128x128 scales), one folder (importing it registers its ops), in the
shape every recipe folder has.

recipe.py: the recipe object and its options, which registers moepass::blockwise_linear, blockwise_grouped_mm and their
_dgrad / _wgrad through the op families (ops/lowp/linear.py, grouped_mm.py) from the GEMMs of linear.py and
grouped_mm.py, then the recipe; quant.py: the tile and block quantizers in plain torch (and the 128 tile); decomp.py:
the Inductor decompositions of the kernel "scaled_mm" ops (their quantization in plain torch, fused by Inductor, around
the GEMM ops, which stay opaque: Inductor's _scaled_mm lowering refuses blockwise scales once shapes are symbolic);
kernels/: which implementation runs where, and why (choice.py), the GEMM and its opaque ops (gemm.py), the Triton
grouped GEMMs (triton_grouped.py) and DeepGEMM's (deepgemm.py, deepgemm_check.py).
"""

from .recipe import BLOCKWISE  # importing it registers moepass::blockwise_*

__all__ = ["BLOCKWISE"]
