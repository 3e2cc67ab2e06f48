"""The blockwise FP8 recipe (DeepSeek-V3's 1x128 / 128x128 scales), one folder (importing it registers its ops).

recipe.py: the recipe object and its options, which registers moepass::blockwise_linear, blockwise_grouped_mm and their
_dgrad / _wgrad through the op families (ops/lowp/linear.py, grouped_mm.py) from the GEMMs of linear.py and
grouped_mm.py; quant.py: the tile and block quantizers in plain torch (and the 128 tile); gemm.py: the one GEMM
form (A @ B.T, both K-major) on torch._scaled_mm or emulated, and the opaque GEMM ops moepass::blockwise_scaled_mm /
blockwise_scaled_grouped_mm that kernel "scaled_mm" runs it through; decomp.py: the Inductor decompositions of the
kernel "scaled_mm" ops (their quantization in plain torch, fused by Inductor, around those GEMM ops, which stay
opaque: Inductor's _scaled_mm lowering refuses blockwise scales once shapes are symbolic); kernels.py: which
implementation runs where, and why; triton_grouped.py: the grouped GEMMs as two Triton kernels (kernel "triton", one
launch per GEMM); deepgemm.py, deepgemm_check.py: the grouped GEMMs on DeepGEMM (optional, through torchao) and their
self-check.
"""

from .recipe import BLOCKWISE  # importing it registers moepass::blockwise_*

__all__ = ["BLOCKWISE"]
