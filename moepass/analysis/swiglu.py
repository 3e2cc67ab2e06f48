"""SwiGLU in a Dynamo graph: h = silu(gate) * up, however a model spells it.

`F.silu(gate) * up` (DeepSeek's reference, torchtitan, moepass's model), `self.act_fn(gate) * up` with an nn.SiLU or
transformers' ACT2FN["silu"] (Dynamo inlines both to F.silu), `torch.mul`, `.mul`, either operand order,
`gate * torch.sigmoid(gate) * up` and `gate.sigmoid() * gate * up`. gate and up may be halves of one GEMM's output
(`gate_up.chunk(2, -1)`): only the values matter.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx

_MULS = {operator.mul, torch.mul, torch.Tensor.mul, "mul"}
_SILUS = {F.silu, torch.ops.aten.silu.default}
_SIGMOIDS = {torch.sigmoid, torch.Tensor.sigmoid, "sigmoid", F.sigmoid}


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op in ("call_function", "call_method") and node.target in targets


def _mul_operands(node) -> tuple[fx.Node, fx.Node] | None:
    if not _is(node, _MULS) or len(node.args) != 2 or node.kwargs:
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
