"""Which low-precision op one GEMM becomes: recipe, kernel and trailing op arguments, or why it stays BF16.

Shared by the linear and grouped-GEMM passes: both ask the same questions, only the GEMM kind differs. Generic over
the recipes: whatever a recipe decides, it decides through its object (moepass.recipes.registry.RECIPES).
"""

from __future__ import annotations

import dataclasses

import torch

from moepass.analysis.graph import replace_node
from moepass.option_types import OptionsError
from moepass.skips import Reason, SkipCode

from .auto import choose_recipe
from .registry import RECIPES

AUTO = "auto"  # the `recipe` option's value that lets recipes.auto choose per GEMM


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    recipe: str  # a name in RECIPES
    why: str
    kernel: str
    kernel_why: str
    op_name: str  # e.g. "mxfp8_grouped_mm", "fp8_rowwise_linear"
    recipe_args: tuple  # the op's arguments after its tensors

    @property
    def op(self):
        return getattr(torch.ops.moepass, self.op_name).default

    @property
    def detail(self) -> str:
        return f"recipe={self.recipe} kernel={self.kernel}: {self.why}"


def resolve_recipe(requested: str, device: torch.device | str, kind: str, m, k: int, n: int,
                   experts: int | None = None, expected=None, measure: bool = False) -> tuple[str, str]:
    """The `recipe` option applied to one GEMM: an explicit recipe is honoured, "auto" chooses (a recipe's name,
    or auto.BF16 to leave it alone)."""
    if requested != AUTO and requested not in RECIPES:
        raise OptionsError(f"moepass: recipe={requested!r} is not one of {[AUTO, *RECIPES]}")
    if requested == AUTO:
        return choose_recipe(device, kind, m, k, n, experts, expected, measure)
    return requested, f"recipe={requested!r} requested"


def plan_gemm(config, kind: str, device: torch.device, m, k: int, n: int, experts: int | None = None,
              expected=None) -> GemmPlan | Reason:
    """A GemmPlan for a `kind` ("linear" or "grouped") GEMM of M x K x N, or the reason it is left alone.

    expected: a callable giving the rows to expect where M is data dependent (recipes.auto.choose_recipe)."""
    requested = config.section("").recipe
    name, why = resolve_recipe(requested, device, kind, m, k, n, experts=experts, expected=expected,
                               measure=requested == AUTO and config.section("auto").measure)
    recipe = RECIPES.get(name)
    if recipe is None:  # recipe=auto left it in BF16
        return Reason(SkipCode.LEFT_IN_BF16, why)
    problem = recipe.shape_problem(k, n)
    if problem:
        return problem
    kernel, kernel_why = recipe.kernel(config, device, kind)
    if kernel is None:  # the recipe has no kernel for this GEMM kind on this device
        return Reason(SkipCode.NO_KERNEL, f"{recipe.name}: no kernel for {kind} GEMMs here (kept BF16): {kernel_why}")
    wgrad_bf16, wgrad_why = recipe.wgrad_bf16(config, kind)
    if wgrad_why:
        why = f"{why}; {wgrad_why}"
    args = (*recipe.settings(config), wgrad_bf16, kernel)
    return GemmPlan(recipe.name, why, kernel, kernel_why, recipe.forward_op_name(kind), args)


def apply_plan(record, graph, node, module: str, plan: GemmPlan | Reason, operands: tuple, shape: str) -> None:
    """Put the plan's op on `operands` in place of `node` and record it; a Reason is why it stays."""
    if isinstance(plan, Reason):
        record.skip(node, module, plan)
        return
    record.implementations[plan.kernel] = plan.kernel_why
    replace_node(graph, node, plan.op, (*operands, *plan.recipe_args))
    record.replace(node, module, f"moepass.{plan.op_name}", f"{shape} {plan.detail}")
