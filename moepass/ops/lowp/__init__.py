"""moepass's low-precision GEMM ops: the op families once, then every recipe's ops (importing this registers them).

Families (one per GEMM kind, instantiated per recipe): linear.py, grouped_mm.py (schemas, checks, fakes, autograd,
with sharding.py's DTensor strategies), from op_recipe.py and gemm_args.py; grouped_mm_rows.py: the grouped forward
on rows quantized before their gather (recipes that scale x per row); grouped_wgrad_bf16.py: the BF16 grouped
wgrad of every recipe's `wgrad_bf16` option. Per recipe (moepass.recipes.RECIPES names its ops module): mxfp8.py
(+ mxfp8_kernels.py, mxfp8_token_groups.py) and fp8_rowwise/. torchao is imported lazily inside the MXFP8 op
bodies, so this stays cheap.
"""

import importlib

from moepass.recipes import RECIPES

from . import grouped_wgrad_bf16  # noqa: F401  (registers moepass::grouped_mm_wgrad_bf16)

for _recipe in RECIPES.values():
    importlib.import_module(_recipe.ops_module)
