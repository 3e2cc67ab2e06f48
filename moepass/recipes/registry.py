"""The low-precision recipes by name: what the `recipe` option picks among (besides "auto"), and what they add up to.

Each recipe is a folder, moepass/ops/lowp/<name>/, whose recipe.py holds the object (base.Recipe), registers its ops
and then the recipe here: `import moepass` imports moepass.ops, which imports every built-in folder (in the `recipe`
option's order), so any `import moepass.<anything>` finds them registered. A recipe from elsewhere (a test's, a
user's) joins with the same one call, `register(recipe)`, after importing its module; the options table, the
`recipe` choices and `moepass options` then list it. This module imports no recipe: recipes/ sits below ops/.
"""

from __future__ import annotations

import torch

from .base import GEMM_OPS, Recipe

RECIPES: dict[str, Recipe] = {}  # in the order registered: the `recipe` option's order


def register(recipe: Recipe) -> Recipe:
    """Add `recipe` under its name: its ops must be registered (import its recipe module first), its options named
    after it; `unregister(recipe.name)` takes it back."""
    if recipe.name in RECIPES or recipe.name == "auto":
        raise ValueError(f"a recipe named {recipe.name!r} is already registered: {RECIPES.get(recipe.name)!r}")
    missing = [recipe.op_name(op) for op in GEMM_OPS if not hasattr(torch.ops.moepass, recipe.op_name(op))]
    if missing:
        raise ValueError(f"recipe {recipe.name!r}: ops {missing} are not registered (import its recipe module first)")
    keys = {o.key for o in recipe.options}
    if not {recipe.kernel_option, recipe.wgrad_option, *recipe.decomposition_options} <= keys:
        raise ValueError(f"recipe {recipe.name!r}: its Options need fields kernel and wgrad_bf16 (and every "
                         f"decomposition option); it declares {sorted(keys)}")
    RECIPES[recipe.name] = recipe
    return recipe


def unregister(name: str) -> Recipe:
    """Remove the recipe registered under `name` (a test's, after use)."""
    return RECIPES.pop(name)


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
