"""SwiGLU in a Dynamo graph: h = silu(gate) * up, however a model spells it, and the rows an expert GEMM reads made of
it: h times a routing-weight column (as weights_before_gemm leaves it), through casts between float32 and bfloat16.

`F.silu(gate) * up` (DeepSeek's reference, torchtitan, moepass's model), `self.act_fn(gate) * up` with an nn.SiLU or
transformers' ACT2FN["silu"] (Dynamo inlines both to F.silu), `torch.mul`, `.mul`, either operand order,
`gate * torch.sigmoid(gate) * up` and `gate.sigmoid() * gate * up`. gate and up may be halves of one GEMM's output
(`gate_up.chunk(2, -1)`): only the values matter.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import fx

from .graph import is_mul, tensor_meta

_SILUS = {F.silu, torch.ops.aten.silu.default}
_SIGMOIDS = {torch.sigmoid, torch.Tensor.sigmoid, "sigmoid", F.sigmoid}


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _mul_operands(node) -> tuple[fx.Node, fx.Node] | None:
    if not isinstance(node, fx.Node) or not is_mul(node) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


def _silu_input(node) -> fx.Node | None:
    """x when node is silu(x) (not in place)."""
    if _is(node, _SILUS) and len(node.args) == 1 and not node.kwargs.get("inplace", False):
        return node.args[0] if isinstance(node.args[0], fx.Node) else None
    operands = _mul_operands(node)  # x * sigmoid(x), sigmoid(x) * x
    if operands is None:
        return None
    for x, s in (operands, operands[::-1]):
        if _is(s, _SIGMOIDS) and len(s.args) == 1 and s.args[0] is x and not s.kwargs:
            return x
    return None


def swiglu_of(h: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """(gate, up, the nodes between them and h, h last) when h = silu(gate) * up; else None."""
    operands = _mul_operands(h)
    if operands is None:
        return None
    for act, up in (operands, operands[::-1]):
        gate = _silu_input(act)
        if gate is not None and gate is not up:
            inner = [a for a in act.args if isinstance(a, fx.Node) and a is not gate]  # sigmoid(gate), if spelled
            return gate, up, [*inner, act, h]
    return None


@dataclasses.dataclass(frozen=True)
class SwiGLURows:
    """rows = silu(gate) * up [* weight], weight a [M, 1] column or None; chain: the nodes after gate and up, rows
    last."""

    gate: fx.Node
    up: fx.Node
    weight: fx.Node | None
    chain: list[fx.Node]


def swiglu_rows_of(rows: fx.Node) -> SwiGLURows | None:
    """rows as a (weighted) SwiGLU: weights_before_gemm's `(h.float() * w).bfloat16()`, transformers'
    `(proj_out.to(bf16).float() * w).bfloat16()`, or h itself; else None."""
    y, after = _uncast(rows)
    h, weight, weighting = y, None, after
    operands = _mul_operands(y)
    out = tensor_meta(rows)
    for a, w in (operands, operands[::-1]) if operands else ():
        meta = tensor_meta(w)
        if meta is not None and out is not None and tuple(meta.shape) == (out.shape[0], 1) \
                and meta.dtype.is_floating_point:
            h, before = _uncast(a)
            weight, weighting = w, [*before, y, *after]
            break
    found = swiglu_of(h)
    if found is None:
        return None
    gate, up, chain = found
    return SwiGLURows(gate, up, weight, chain + weighting)


def _uncast(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the source of the chain of casts between float32 and bfloat16 that ends at node, those casts in order)."""
    casts = []
    source = _cast_source(node)
    while source is not None:
        casts.insert(0, node)
        node, source = source, _cast_source(source)
    return node, casts


_WIDTHS = (torch.float32, torch.bfloat16)  # casts between them keep what the fused op computes (one BF16 rounding)


def _cast_source(node: fx.Node) -> fx.Node | None:
    """The input of a same-shape cast between float32 and bfloat16 (either way, or to its own dtype), else None."""
    if node.op != "call_method" or node.target not in ("to", "float", "bfloat16") or not node.args \
            or not isinstance(node.args[0], fx.Node):
        return None
    src, out = tensor_meta(node.args[0]), tensor_meta(node)
    if src is None or out is None or tuple(src.shape) != tuple(out.shape) or src.dtype not in _WIDTHS \
            or out.dtype not in _WIDTHS:
        return None
    if node.target == "to" and any(not isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return None  # a device move or a memory-format change
    return node.args[0]
