"""A recipe written outside moepass, as a user would: one folder in the shape moepass's own recipe folders have,
registered with one call.

recipe.py: the recipe object and its options; importing it registers its six ops through moepass's op families
(which give them their fake implementations and autograd) from linear.py and grouped_mm.py (the GEMM bodies);
quant.py: its one rounding; kernels/: its one kernel, plain torch matmuls (reference.py), and the choice (choice.py);
decomp.py: its Inductor decompositions (none). Nothing under moepass/ names it.
"""

from .recipe import BF16_ROUNDTRIP  # importing it registers moepass::bf16_roundtrip_*

__all__ = ["BF16_ROUNDTRIP"]
