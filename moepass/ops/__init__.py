"""moepass custom ops: `import moepass.ops` registers every torch.ops.moepass.* op.

Low-precision GEMMs: one op family per GEMM kind (linear.py, grouped_mm.py: schemas, checks, fakes,
autograd), instantiated per recipe (op_recipe.OpRecipe): MXFP8 (mxfp8_linear, mxfp8_grouped_mm and their
dgrad/wgrad ops) and Hopper FP8 rowwise (fp8_rowwise_linear, fp8_rowwise_grouped_mm and theirs); the BF16
grouped wgrad of both recipes' `wgrad_bf16` option (grouped_mm_wgrad_bf16); expert-parallel
dispatch/combine (ep_*). torchao is imported lazily inside the MXFP8 op bodies, so this stays cheap.
"""

from . import (  # noqa: F401  (each registers its ops)
    ep_dispatch_combine,
    ep_permute,
    fp8_rowwise_both_layouts,
    fp8_rowwise_grouped_mm,
    fp8_rowwise_linear,
    fp8_rowwise_token_groups,
    grouped_wgrad_bf16,
    mxfp8_grouped_mm,
    mxfp8_linear,
)
from .mxfp8_kernels import choose_mxfp8_kernel

__all__ = ["choose_mxfp8_kernel"]
