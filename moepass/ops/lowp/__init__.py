"""moepass's low-precision GEMM ops: the op families once, then a folder per recipe (importing this registers them).

Families (one per GEMM kind, instantiated per recipe): linear.py, grouped_mm.py (schemas, checks, fakes, autograd,
with sharding.py's DTensor strategies), from op_recipe.py and gemm_args.py; grouped_mm_rows.py: the grouped forward
on rows quantized before their gather (recipes that scale x per row); grouped_wgrad_bf16.py: the BF16 grouped
wgrad of every recipe's `wgrad_bf16` option; token_group_padding.py: token groups padded to a block of rows;
formats.py: the FP8 element type. A family never imports a recipe: each recipe's folder (mxfp8/, fp8_rowwise/,
blockwise/) holds its recipe.py, which registers its ops through the families and then its recipe
(moepass.recipes.registry.register). The built-in folders are imported here, in the `recipe` option's order, so that
`import moepass.ops` (which `import moepass` runs) registers every op and every built-in recipe. torchao is imported
lazily inside the op bodies, so this stays cheap.
"""

from . import grouped_wgrad_bf16  # noqa: F401  (registers its ops)
from . import mxfp8, fp8_rowwise, blockwise  # noqa: F401  (each registers its ops and recipe, in this order)
