"""Sizes as expressions, and the small sizes a region is checked at when the graph has symbols.

A graph traced with dynamic shapes (`dynamic=True`, `mark_dynamic`, or Dynamo's automatic dynamic
after a second batch size) holds its token count as an expression of backed symbols (`2*s27*s77`),
bound to graph inputs (`s77: torch.SymInt`). The EP checks then run on a few tokens: each symbol of
the token count gets a small value, every other symbol its example value, so the check's cost does not
grow with the batch. A static graph has no symbols: its sizes are its own.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from moepass.analysis.graph import example_value, tensor_meta

from .dtensors import local_value

SMALL = 8  # value given to each symbol of a dynamic token count (capped at the example's own)


def size_expr(size) -> sympy.Expr:
    """A size as a sympy expression (an Integer when static), simplified by the shape environment."""
    if isinstance(size, int):
        return sympy.Integer(size)
    node = size.node
    shape_env = getattr(node, "shape_env", None)
    return shape_env.replace(node.expr) if shape_env is not None else node.expr


def shape_exprs(node) -> tuple[sympy.Expr, ...] | None:
    """The node's shape; a DTensor's is its local shard's (the EP analysis reads each rank's own data)."""
    t = local_value(tensor_meta(node))
    return None if t is None else tuple(size_expr(s) for s in t.shape)


def same(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Equal for every value of the symbols (never a guard: decided on the expressions)."""
    return a == b or sympy.simplify(a - b) == 0


def numel_expr(sizes) -> sympy.Expr:
    return sympy.Mul(*sizes) if sizes else sympy.Integer(1)


def sample_bindings(token_count: sympy.Expr, node: fx.Node) -> dict[sympy.Symbol, int]:
    """Values for the graph's backed symbols: small for those of the token count, the example's for the rest."""
    if not token_count.free_symbols:
        return {}
    hints = example_sizes(node)
    bindings = dict(hints)
    for s in token_count.free_symbols:
        bindings[s] = min(int(hints.get(s, SMALL)), SMALL)
    return bindings


def example_sizes(node: fx.Node) -> dict[sympy.Symbol, int]:
    """Every backed size symbol of the node's graph at its example value."""
    shape_env = _shape_env(node)
    if shape_env is None:
        return {}
    return {s: int(v) for s, v in backed_values(shape_env).items()}


def backed_values(shape_env) -> dict:
    """The shape environment's backed symbol -> hint table, without the deprecation warning of torch 2.13 (which
    renamed var_to_val, keeping the old name as a warning alias; 2.11 has only var_to_val)."""
    values = getattr(shape_env, "backed_var_to_val", None)
    return shape_env.var_to_val if values is None else values


def concrete(expr: sympy.Expr, bindings: dict) -> int:
    value = expr.subs(bindings) if bindings and expr.free_symbols else expr
    if value.free_symbols:
        raise ValueError(f"size {expr} has symbols without a value ({sorted(map(str, value.free_symbols))})")
    return int(value)


def concrete_shape(node, bindings: dict) -> tuple[int, ...] | None:
    exprs = shape_exprs(node)
    if exprs is None:
        return None
    try:
        return tuple(concrete(e, bindings) for e in exprs)
    except ValueError:
        return None


def bound_symint(node: fx.Node, bindings: dict) -> int | None:
    """The value of a SymInt graph input (`s77`) under `bindings`, or None when it is not one."""
    value = example_value(node)
    if node.op != "placeholder" or not isinstance(value, torch.SymInt):
        return None
    try:
        return concrete(size_expr(value), bindings)
    except ValueError:
        return None


def _shape_env(node: fx.Node):
    for n in [node, *node.all_input_nodes]:
        t = tensor_meta(n)
        fake_mode = getattr(t, "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            return fake_mode.shape_env
    return None
