"""Which low-precision op one GEMM becomes: recipe, kernel and trailing op arguments, or why it stays BF16.

Shared by the linear and grouped-GEMM passes: both ask the same questions, only the GEMM kind differs.
"""

from __future__ import annotations

import dataclasses

import torch

from .fp8_recipe import fp8_rowwise_kernel, fp8_rowwise_wgrad_bf16, recipe_shape_problem, resolve_recipe
from .graph import replace_node
from .gemm_rules import choose_kernel


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    recipe: str  # "mxfp8" or "fp8_rowwise"
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


def plan_gemm(config, kind: str, device: torch.device, m, k: int, n: int, experts: int | None = None,
              expected=None):
    """A GemmPlan for a `kind` ("linear" or "grouped") GEMM of M x K x N, or the reason it is left alone.

    expected: a callable giving the rows to expect where M is data dependent (fp8_recipe.choose_recipe)."""
    recipe, why = resolve_recipe(config["recipe"], device, kind, m, k, n, experts=experts, expected=expected)
    problem = why if recipe == "bf16" else recipe_shape_problem(recipe, k, n)
    if problem:
        return problem
    if recipe == "mxfp8":
        kernel, kernel_why = choose_kernel(config, device)
        args = (config["mxfp8.scale_rounding"], config["mxfp8.wgrad_bf16"], kernel)
    else:
        kernel, kernel_why = fp8_rowwise_kernel(config["fp8_rowwise.kernel"], device, grouped=kind == "grouped")
        wgrad_bf16, wgrad_why = fp8_rowwise_wgrad_bf16(config["fp8_rowwise.wgrad_bf16"], kind)
        why, args = f"{why}; {wgrad_why}", (wgrad_bf16, kernel)
    op_name = f"{recipe}_{'linear' if kind == 'linear' else 'grouped_mm'}"
    return GemmPlan(recipe, why, kernel, kernel_why, op_name, args)


def apply_plan(record, graph, node, module: str, plan: GemmPlan | str, operands: tuple, shape: str) -> None:
    """Put the plan's op on `operands` in place of `node` and record it; a str plan is the reason it stays."""
    if isinstance(plan, str):
        record.skip(node, module, plan)
        return
    record.implementations[plan.kernel] = plan.kernel_why
    replace_node(graph, node, plan.op, (*operands, *plan.recipe_args))
    record.replace(node, module, f"moepass.{plan.op_name}", f"{shape} {plan.detail}")
