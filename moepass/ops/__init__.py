"""moepass custom ops: `import moepass.ops` registers every torch.ops.moepass.* op.

lowp/: the low-precision GEMMs, one op family per GEMM kind (linear, grouped_mm) instantiated per recipe
(moepass.recipes): MXFP8 and Hopper FP8 rowwise, each with its dgrad and wgrad ops, and the BF16 grouped wgrad.
ep/: expert-parallel dispatch/combine (DeepEP or a torch.distributed reference) and the expert-major permutation.
What each op does (GEMM kind and role, EP exchange) is recorded in moepass.analysis.op_registry as it is defined.
"""

from . import ep, lowp  # noqa: F401  (each registers its ops)
