"""The FP8-rowwise recipe, one folder (importing it registers its ops), in the shape every recipe folder has.

recipe.py: the recipe object and its options, which registers moepass::fp8_rowwise_linear, fp8_rowwise_grouped_mm and
their _dgrad / _wgrad through the op families (ops/lowp/linear.py, grouped_mm.py) from the GEMMs of linear.py and
grouped_mm.py, then the recipe; quant.py: the rowwise e4m3 quantization (and the 16-row alignment); decomp.py: kernel
"scaled_mm" in plain torch, and its Inductor decompositions; kernels/: which implementation runs where (choice.py), the
FP8 GEMM primitives (scaled_gemms.py), and the quantization ops the decompositions call
(moepass::fp8_rowwise_expert_weights, _rows_and_cols, _token_group_cols) with their Triton kernels.
"""

from .recipe import FP8_ROWWISE  # importing it registers moepass::fp8_rowwise_*

__all__ = ["FP8_ROWWISE"]
