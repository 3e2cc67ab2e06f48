"""The blockwise recipe's kernels and the choice among them (nothing is imported here: each module loads on use).

choice.py: which implementation runs where ("scaled_mm", "triton", "deepgemm" or "emulated"), each checked once per
device, and the check every op call makes; gemm.py: the one GEMM form (A @ B.T, both K-major) on torch._scaled_mm or
emulated, and the opaque GEMM ops moepass::blockwise_scaled_mm / blockwise_scaled_grouped_mm /
blockwise_triton_grouped_mm the kernels run it through; triton_grouped.py: the grouped GEMMs as two Triton kernels
(kernel "triton", one launch per GEMM); deepgemm.py, deepgemm_check.py: the grouped GEMMs on DeepGEMM (optional,
through torchao) and their self-check, run in a child process.
"""
