"""A recipe written outside moepass, as a user would: one folder, registered with one call.

recipe.py: the recipe object and its options; importing it registers its six ops through moepass's op families
(which give them their fake implementations and autograd); gemms.py: the reference kernels, plain torch matmuls.
Nothing under moepass/ names it.
"""

from .recipe import BF16_ROUNDTRIP  # importing it registers moepass::bf16_roundtrip_*

__all__ = ["BF16_ROUNDTRIP"]
