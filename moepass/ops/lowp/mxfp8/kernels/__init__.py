"""The MXFP8 recipe's kernel choice (nothing is imported here: each module loads on use).

choice.py: which implementation runs where (torchao's native sm_100 kernels or emulation), the check every op call
makes, and the torchao settings the ops pass (kernel preference, scale rounding). The kernels themselves are
torchao's: moepass has none of its own for this recipe.
"""
