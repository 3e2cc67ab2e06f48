"""The FP8-rowwise recipe, one folder (importing it registers its ops).

recipe.py: the recipe object and its options, which registers moepass::fp8_rowwise_linear, fp8_rowwise_grouped_mm and
their _dgrad / _wgrad through the op families (ops/lowp/linear.py, grouped_mm.py) from the GEMMs of linear.py and
grouped_mm.py; kernels.py: which implementation runs where; quant.py: the rowwise e4m3 quantization (and the 16-row
alignment); decomp.py: kernel "scaled_mm" in plain torch, and its Inductor decompositions; scaled_gemms.py: the FP8
GEMM primitives; triton_kernels.py, both_layouts.py, token_groups.py: the quantization kernels and the ops the
decompositions call (moepass::fp8_rowwise_expert_weights, _rows_and_cols, _token_group_cols).
"""

from .recipe import FP8_ROWWISE  # importing it registers moepass::fp8_rowwise_*

__all__ = ["FP8_ROWWISE"]
