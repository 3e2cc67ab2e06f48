"""What a recipe hands the shared op families (linear.py, grouped_mm.py): data, not code paths.

The recipe object (moepass.recipes.base.Recipe) names the ops (moepass::<name>_linear, <name>_grouped_mm and their
_dgrad / _wgrad), declares its own settings (arguments before `wgrad_bf16` and `kernel` in every schema) and the
multiple K and N must be. Its folder (ops/lowp/<name>/) adds the GEMM bodies and the check of its settings and
kernel on a device (RecipeGemms); its recipe.py calls the families, which register the ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from moepass.recipes.base import Recipe

from ..fresh_outputs import fresh_outputs
from .gemm_args import check_multiple


@dataclasses.dataclass(frozen=True)
class RecipeGemms:
    """One GEMM kind's forward, dgrad and wgrad, called after the family's checks as f(*tensors, *settings, kernel),
    and `check_settings(device, grouped, *settings, kernel)`, which raises on a bad setting or a kernel that cannot
    run on the device."""

    forward: Callable
    dgrad: Callable
    wgrad: Callable
    check_settings: Callable[..., None]


def check_dims(recipe: Recipe, op: str, **dims: int) -> None:
    """K and N (by name) multiples of the recipe's block."""
    check_multiple(op, recipe.multiple, recipe.multiple_why, **dims)


def split_forward_args(args: tuple) -> tuple[tuple, bool]:
    """A forward op's trailing (*settings, wgrad_bf16, kernel) -> ((*settings, kernel), wgrad_bf16)."""
    *settings, wgrad_bf16, kernel = args
    return (*settings, kernel), wgrad_bf16


def define_op(name: str, params: list[str], check: Callable, compute: Callable, output: Callable):
    """Register moepass::<name>(params) -> Tensor. Real: check, then compute, whose result the caller may view and
    modify in place (fresh_outputs); fake: check, then an empty `output` (so a bad call fails at compile time). All
    three take the op's arguments."""

    def impl(*args):
        check(*args)
        return fresh_outputs(compute(*args), args)

    def fake(*args):
        check(*args)
        return output(*args)

    op = torch.library.custom_op(f"moepass::{name}", impl, mutates_args=(), schema=f"({', '.join(params)}) -> Tensor")
    op.register_fake(fake)
    return op
