"""The FP8-rowwise recipe's ops (the recipe is moepass.recipes.fp8_rowwise): importing this registers them.

linear.py, grouped_mm.py: moepass::fp8_rowwise_linear, fp8_rowwise_grouped_mm and their _dgrad / _wgrad (the op
families are ops/lowp/linear.py, grouped_mm.py); kernels.py: which implementation runs where; quant.py: the
rowwise e4m3 quantization; decomp.py: kernel "scaled_mm" in plain torch, and its Inductor decompositions;
scaled_gemms.py: the FP8 GEMM primitives; triton_kernels.py, both_layouts.py, token_groups.py: the quantization
kernels and the ops the decompositions call (moepass::fp8_rowwise_expert_weights, _rows_and_cols,
_token_group_cols).
"""

from . import both_layouts, grouped_mm, linear, token_groups  # noqa: F401  (each registers its ops)
