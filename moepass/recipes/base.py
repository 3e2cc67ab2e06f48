"""What a low-precision recipe is: the one object the planner, the op families, the backend and the cache key ask.

A recipe is one folder, moepass/ops/lowp/<name>/: its recipe.py holds the object (a Recipe), which declares its
options (Options: a frozen dataclass read under "<name>.", with at least `kernel` and `wgrad_bf16`), names its ops
(moepass::<name>_linear, <name>_grouped_mm and their _dgrad / _wgrad, which recipe.py registers through the op
families from its GEMM bodies), states the block K and N must be multiples of, its kernel per device and GEMM kind
("linear" or "grouped"; or none, and the GEMM stays BF16), the arguments a plan appends to its ops, its wgrad_bf16
policy, and what else shapes the compiled code: its Inductor decompositions and their cache variant.
moepass.recipes.registry holds the recipes by name; `register(recipe)` adds one from anywhere.

Every recipe folder has one shape (RECIPE_FOLDER), a recipe from outside moepass too (tests/unit/toy_recipe/):
  recipe.py      the recipe: its Options, the Recipe object, its ops registered through the op families from the GEMM
                 bodies below, then register(RECIPE) (a recipe from outside moepass: the one call its user makes);
  linear.py      the linear GEMM bodies (forward, dgrad, wgrad: GEMMS), which the op family ops/lowp/linear.py turns
                 into autograd ops;
  grouped_mm.py  the grouped GEMM bodies, likewise (ops/lowp/grouped_mm.py; grouped_mm_rows.py for rows quantized
                 before their gather);
  quant.py       the quantization (its reference numerics, or calls into a library's kernels) and the block or
                 alignment it needs, which the recipe states as `multiple`;
  kernels/       a package: the kernel choice (kernels/choice.py: which implementation runs where, and the check
                 every op call makes) and the kernels (Triton, GEMM primitives, the custom ops around them), one idea
                 per module;
  decomp.py      its Inductor decompositions (an empty table is an answer).
Nothing else sits at its top level but __init__.py (tests/unit/test_recipes.py checks every folder).
"""

from __future__ import annotations

import torch

from moepass.option_types import Option, read, section_options
from moepass.skips import Reason, SkipCode

# GEMM kind ("linear": y = x @ W.T; "grouped": MoE expert GEMMs x[M,K] @ w_t[E,K,N] per token group) -> its op family
FAMILIES = {"linear": "linear", "grouped": "grouped_mm"}
# the six GEMM ops every recipe registers, each as moepass::<name>_<op>
GEMM_OPS = ("linear", "linear_dgrad", "linear_wgrad", "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad")
# what a recipe's folder holds besides __init__.py ("/": a package), as the module docstring describes
RECIPE_FOLDER = ("recipe.py", "linear.py", "grouped_mm.py", "quant.py", "kernels/", "decomp.py")


class Recipe:
    name: str  # the ops' name prefix and the `recipe` option's value
    Options: type  # frozen dataclass of its options, read under "<name>."; fields `kernel`, `wgrad_bf16` at least
    multiple: int  # K and N must be multiples of it (its block, or its kernels' alignment)
    multiple_why: str  # for the ops' error messages
    op_settings: tuple[str, ...] = ()  # schema of its own op arguments, before `bool wgrad_bf16, str kernel`
    decomposition_options: tuple[str, ...] = ()  # options that shape compiled code through its decompositions only
    decomposed_gemms: tuple[str, ...] = ()  # aten GEMMs its decompositions leave in compiled graphs

    # ---- its options

    @property
    def options(self) -> tuple[Option, ...]:
        """Its options as the table lists them, keyed "<name>.<field>"."""
        return section_options(self.Options, self.name)

    def read(self, config):
        """Its options under `config` (a Config or a dict of option keys), as its frozen Options."""
        return read(self.Options, config, self.name)

    def check_options(self, options) -> None:
        """Raise OptionsError for a combination of its options (its Options) that cannot work together."""

    @property
    def kernel_option(self) -> str:
        return f"{self.name}.kernel"

    @property
    def wgrad_option(self) -> str:
        return f"{self.name}.wgrad_bf16"

    # ---- its ops

    def op_name(self, gemm: str) -> str:
        """gemm: "linear", "linear_dgrad", "grouped_mm_wgrad", ... -> the op's name under torch.ops.moepass."""
        return f"{self.name}_{gemm}"

    def op(self, gemm: str):
        return getattr(torch.ops.moepass, self.op_name(gemm))

    def forward_op_name(self, kind: str) -> str:
        """The forward op a GEMM of `kind` becomes."""
        return self.op_name(FAMILIES[kind])

    # ---- what the planner asks

    def shape_problem(self, k, n) -> Reason | None:
        """None when its kernels take K and N (positive multiples of `multiple`), else what is off."""
        if k == 0 or n == 0:  # 0 is a multiple of anything, but there is nothing to quantize (a zero-width expert)
            return Reason(SkipCode.EMPTY_GEMM, f"{self.name}: empty GEMM (K={k}, N={n}): nothing to quantize")
        bad = [f"{name}={v} not a multiple of {self.multiple}" for name, v in (("K", k), ("N", n))
               if not isinstance(v, int) or v % self.multiple]
        return Reason(SkipCode.NOT_A_MULTIPLE, f"{self.name}: {', '.join(bad)}") if bad else None

    def choose_kernel(self, requested: str, device: torch.device | str, kind: str) -> tuple[str | None, str]:
        """(kernel, why) for a GEMM of `kind` on `device`, honouring the `<name>.kernel` option's value; kernel None:
        no kernel of the recipe runs that kind here (the planner leaves the GEMM in BF16, `why` its reason)."""
        raise NotImplementedError

    def kernel(self, config, device: torch.device | str, kind: str) -> tuple[str | None, str]:
        return self.choose_kernel(self.read(config).kernel, device, kind)

    def choose_wgrad_bf16(self, requested, kind: str) -> tuple[bool, str]:
        """(weight gradient in BF16?, why, "" when there is nothing to say) for the `<name>.wgrad_bf16` value."""
        return requested, ""

    def wgrad_bf16(self, config, kind: str) -> tuple[bool, str]:
        return self.choose_wgrad_bf16(self.read(config).wgrad_bf16, kind)

    def settings(self, config) -> tuple:
        """The values of `op_settings` under `config`."""
        return ()

    # ---- what the backend and the cache key ask

    def settle(self, config, weights_sharded: bool):
        """`config` with this recipe's "auto" decomposition options decided for one graph (weights_sharded: its
        GEMMs' weights are gathered by FSDP2 for the step and resharded after)."""
        return config

    def decompositions(self, config) -> dict:
        """{OpOverload: decomposition} for Inductor under `config` (and the fallbacks they need registered)."""
        return {}

    def cache_variant(self, config) -> str:
        """Its `decomposition_options` set away from their defaults: the decompositions are in no cache key."""
        options, defaults = self.read(config), self.Options()
        fields = [key.removeprefix(f"{self.name}.") for key in self.decomposition_options]
        return "+".join(f"{self.name}.{f}={getattr(options, f)}" for f in fields
                        if getattr(options, f) != getattr(defaults, f))

    def __repr__(self) -> str:
        return f"<recipe {self.name}>"
