"""The low-precision recipes, one object each, by name: what the `recipe` option picks among (besides "auto").

A recipe (base.Recipe) owns its options, kernel choice, alignment, op arguments, decompositions and cache variant;
its ops live in its ops module (moepass/ops/lowp/), which `import moepass.ops` imports for every recipe here.
Adding a recipe: its module here, its ops module, and one line in RECIPES.
"""

from __future__ import annotations

from .base import Recipe
from .blockwise import BLOCKWISE
from .fp8_rowwise import FP8_ROWWISE
from .mxfp8 import MXFP8

RECIPES: dict[str, Recipe] = {r.name: r for r in (MXFP8, FP8_ROWWISE, BLOCKWISE)}


def settle(config, weights_sharded: bool):
    """`config` with every recipe's "auto" decomposition options decided for one graph (Recipe.settle)."""
    for recipe in RECIPES.values():
        config = recipe.settle(config, weights_sharded)
    return config


def decompositions(config) -> dict:
    """Every recipe's Inductor decompositions under `config` (moepass's own ops are their only keys)."""
    return {op: fn for recipe in RECIPES.values() for op, fn in recipe.decompositions(config).items()}


def cache_variant(config) -> str:
    """What shapes compiled code beyond the graph and moepass's sources (the decompositions' options): for
    CompiledGraphAudit's uuid; "" with every such option at its default."""
    return "+".join(v for v in (recipe.cache_variant(config) for recipe in RECIPES.values()) if v)


def decomposed_gemms() -> set[str]:
    """The aten GEMMs the recipes' decompositions leave in compiled graphs (the audit reports them)."""
    return {gemm for recipe in RECIPES.values() for gemm in recipe.decomposed_gemms}


__all__ = ["RECIPES", "Recipe", "MXFP8", "FP8_ROWWISE", "BLOCKWISE", "settle", "decompositions", "cache_variant",
           "decomposed_gemms"]
