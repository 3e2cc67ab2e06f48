"""The blockwise FP8 recipe's ops (DeepSeek-V3's 1x128 / 128x128 scales; the recipe is moepass.recipes.blockwise):
importing this registers them.

linear.py, grouped_mm.py: moepass::blockwise_linear, blockwise_grouped_mm and their _dgrad / _wgrad (the op families
are ops/lowp/linear.py, grouped_mm.py); quant.py: the tile and block quantizers in plain torch; gemm.py: the one GEMM
form (A @ B.T, both K-major) on torch._scaled_mm or emulated; kernels.py: which implementation runs where, and why;
deepgemm.py, deepgemm_check.py: the grouped GEMMs on DeepGEMM (optional, through torchao) and their self-check.
The ops stay opaque to Inductor (no decompositions): its _scaled_mm lowering refuses blockwise scales once shapes are
symbolic.
"""

from . import grouped_mm, linear  # noqa: F401  (each registers its ops)
