"""The MXFP8 recipe, one folder, in the shape every recipe folder has: recipe.py (the recipe object, its options, and
its ops registered from linear.py and grouped_mm.py, the six GEMMs on torchao's MX kernels or emulated), quant.py (the
MX quantization), kernels/ (which implementation runs where, and the torchao settings), decomp.py (the emulated ops on
CUDA as plain torch for Inductor). Importing it registers its ops.
"""

from .recipe import MXFP8  # importing it registers moepass::mxfp8_*

__all__ = ["MXFP8"]
