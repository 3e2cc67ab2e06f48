"""Eligibility rules shared by the two low-precision GEMM passes (linear and grouped_mm).

Each rule returns None when a GEMM may be rewritten, else the Reason it stays, which a user can act on. What a
recipe's kernels take (K and N alignment) is the recipe's own rule (moepass.recipes.base.Recipe.shape_problem); the
precision a GEMM runs in (BF16 as held, BF16 by autocast, or not) is moepass.analysis.autocast.gemm_precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .graph import matches_any
from ..skips import Reason, SkipCode

if TYPE_CHECKING:  # a type only: options.py sits above analysis/
    from ..options import Config


def module_filter_problem(path: str, config: Config) -> Reason | None:
    lowp = config.section("lowp")
    hit = matches_any(path, lowp.exclude)
    if hit is not None:
        return Reason(SkipCode.EXCLUDED, f"excluded by lowp.exclude pattern {hit!r}")
    if matches_any(path, lowp.include) is None:
        return Reason(SkipCode.NOT_INCLUDED,
                      f"module path {path!r} matches no lowp.include pattern {list(lowp.include)}")
    return None
