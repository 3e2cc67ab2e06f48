"""The FP8-rowwise recipe's kernels and the choice among them (nothing is imported here: each module loads on use).

choice.py: which implementation runs where ("scaled_mm" or "emulated"), and the check every op call makes;
scaled_gemms.py: the FP8 GEMM primitives (torch._scaled_mm / _scaled_grouped_mm, rowwise scales);
both_layouts.py: the ops moepass::fp8_rowwise_expert_weights and _rows_and_cols (an operand quantized once into the two
layouts its GEMMs read), on the Triton kernels of triton_both_layouts.py;
token_group_cols.py: the op moepass::fp8_rowwise_token_group_cols (the grouped wgrad's padded operand layout), on the
Triton kernel of triton_token_group_cols.py;
swiglu.py: an expert MLP's SwiGLU fused with the quantization of w2's rows, keeping gate and up in FP8 (the body of
moepass::fp8_rowwise_swiglu_rows, which ops/lowp/swiglu_rows.py registers), on the Triton kernel of triton_swiglu.py;
triton_zero_rows.py: the Triton kernel zeroing the grouped GEMMs' rows after the last token group.
"""
