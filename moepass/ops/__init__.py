"""moepass custom ops: `import moepass.ops` registers every torch.ops.moepass.* op.

torchao is imported lazily inside the op bodies, so importing this package stays cheap.
"""

from . import mxfp8_grouped_mm, mxfp8_linear  # noqa: F401  (registers moepass::mxfp8_*)
from .mxfp8_kernels import choose_mxfp8_kernel

__all__ = ["choose_mxfp8_kernel"]
