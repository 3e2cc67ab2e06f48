"""Decompositions that may decline, and the Inductor lowerings for the ops they decline (returns NotImplemented:
kernel "emulated", say), shared by every recipe that hands Inductor a decomposition table.

Inductor refuses to create a fallback on the fly for an op that has an entry in its decomposition table ("both a
fallback and a decomp for same op"), so register, once per op, the fallback it would have made.
"""

from __future__ import annotations

from collections.abc import Callable

from moepass.recipes.base import GEMM_OPS


def decomposition(body: Callable, applies: Callable, *, forward: bool = False) -> Callable:
    """A moepass GEMM op's decomposition: `body(*args)` (the plain torch its kernel runs) where `applies(args)` holds,
    else NotImplemented (the op stays one call). The ops take their kernel last; a forward op also carries, just
    before it, the wgrad_bf16 its backward reads, which `body` does not take (forward=True drops it)."""
    def decompose(*args):
        if not applies(args):
            return NotImplemented
        return body(*args[:-2], args[-1]) if forward else body(*args)
    return decompose


FORWARD_OPS = ("linear", "grouped_mm")


def gemm_decompositions(recipe, bodies: dict[str, Callable], applies: Callable) -> dict:
    """{moepass::<recipe.name>_<op>: decomposition} for a recipe's six GEMM ops (GEMM_OPS), each op's body named by
    op."""
    import torch

    assert set(bodies) == set(GEMM_OPS), sorted(bodies)
    return {getattr(torch.ops.moepass, f"{recipe.name}_{name}").default:
            decomposition(bodies[name], applies, forward=name in FORWARD_OPS) for name in GEMM_OPS}


def register_fallbacks(ops) -> None:
    from torch._inductor.lowering import lowerings, make_fallback

    for op in ops:
        if op not in lowerings:
            make_fallback(op, layout_constraint=_default_layout_constraint(op), warn=False, override_decomp=True)


def _default_layout_constraint(op):
    """The stride constraint Inductor's implicit fallback gives a custom op (torch 2.11-2.13 internals)."""
    try:
        from torch._inductor.lowering import tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:
        return None
    return tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
