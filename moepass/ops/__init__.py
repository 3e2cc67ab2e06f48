"""moepass custom ops: `import moepass.ops` registers every torch.ops.moepass.* op.

lowp/: the low-precision GEMMs, one op family per GEMM kind (linear, grouped_mm) instantiated per recipe, a folder
each (lowp/mxfp8/, fp8_rowwise/, blockwise/: the recipe object, its GEMMs, kernels and decompositions), each with its
dgrad and wgrad ops, and the BF16 grouped wgrad.
ep/: expert-parallel dispatch/combine (DeepEP or a torch.distributed reference) and the expert-major permutation.
rows/: moepass::segment_sum_rows, the scatter-adds of routed rows back to tokens as sorted segment sums.
fresh_outputs.py: what every op body returns through, so the code after an op may view and modify its outputs in place.
What each op does (GEMM kind and role, EP exchange) is recorded in moepass.op_registry as it is defined.
"""

from . import ep, lowp, rows  # noqa: F401  (each registers its ops)
