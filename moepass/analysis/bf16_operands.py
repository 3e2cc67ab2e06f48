"""A low-precision GEMM op's operands under mixed precision: activations cast to BF16 where autocast casts them, and
an FP32 weight read as it is, not through the BF16 copy the model makes of it.

Autocast casts a linear's FP32 operands to BF16 at dispatch; the rewrite puts that cast of the activation (and of
the bias) in the graph, and hands the op the FP32 weight, which it quantizes straight to FP8. Models that run
torch._grouped_mm under autocast cast its operands themselves (torchtitan: `w.bfloat16().transpose(-2, -1)`): the
weight operand is then a BF16 copy of an FP32 parameter, which the rewrite reads through, applying the same views to
the FP32 tensor instead. Either way the weight's gradient reaches it in FP32, as autocast's cast would give it.
"""

from __future__ import annotations

import torch
from torch import fx

from .emit import fake_value
from .graph import op_short_name, tensor_meta

BF16 = torch.bfloat16
# views a weight goes through between its cast and the GEMM (value-preserving, shape-only)
_VIEWS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "getitem", "__getitem__", "unsqueeze",
          "squeeze", "T", "mT", "select", "narrow", "movedim", "swapaxes", "swapdims", "flatten", "unflatten",
          "expand"}
_CASTS = {"to", "bfloat16", "type", "type_as", "_to_copy"}
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack")


def _is_bf16_cast(node: fx.Node) -> bool:
    """`t.to(torch.bfloat16)`, `t.bfloat16()`, `t.type(torch.bfloat16)`, `t.type_as(b)` of a float32 t, same shape."""
    if node.op not in ("call_function", "call_method") or op_short_name(node) not in _CASTS or not node.args:
        return False
    src, out = tensor_meta(node.args[0]), tensor_meta(node)
    if src is None or out is None or src.dtype != torch.float32 or out.dtype != BF16 or src.shape != out.shape:
        return False
    if op_short_name(node) in ("to", "_to_copy"):  # a device move or a memory-format change is no plain cast
        return all(isinstance(a, torch.dtype) for a in node.args[1:]) and set(node.kwargs) <= {"dtype"}
    return True


def bf16_copy_of(weight: fx.Node) -> tuple[fx.Node, list[fx.Node], fx.Node] | None:
    """(the float32 tensor, the views after the cast in the order they apply, the cast) when `weight` is a BF16 copy
    of a float32 tensor (through views); else None."""
    views, node = [], weight
    while isinstance(node, fx.Node) and node.op in ("call_function", "call_method") \
            and op_short_name(node) in _VIEWS and node.args and isinstance(node.args[0], fx.Node):
        views.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or not _is_bf16_cast(node):
        return None
    return node.args[0], views[::-1], node


def _copy_provenance(node: fx.Node, like: fx.Node) -> None:
    for key in _PROVENANCE:
        if key in like.meta:
            node.meta.setdefault(key, like.meta[key])


def without_bf16_copy(graph: fx.Graph, weight: fx.Node, before: fx.Node) -> fx.Node:
    """`weight`, or where it is a BF16 copy of a float32 tensor, that tensor through the same views (nodes inserted
    before `before`), so the op reads the float32 weight and no BF16 copy is made."""
    found = bf16_copy_of(weight)
    if found is None:
        return weight
    source, views, _ = found
    fake_mode = getattr(tensor_meta(source), "fake_mode", None)
    added, node = [], source
    with graph.inserting_before(before):
        for view in views:
            node = graph.create_node(view.op, view.target, (node, *view.args[1:]), dict(view.kwargs))
            added.append(node)
            fake_value(node, fake_mode)
            _copy_provenance(node, view)
            if tensor_meta(node) is None:  # a view that cannot be replayed on the float32 tensor: keep the copy
                for new in reversed(added):
                    graph.erase_node(new)
                return weight
    return node


def cast_to_bf16(graph: fx.Graph, operand: fx.Node, before: fx.Node) -> fx.Node:
    """`operand.to(torch.bfloat16)` inserted before `before`: the cast autocast makes at dispatch."""
    with graph.inserting_before(before):
        node = graph.call_method("to", (operand, BF16))
    node.meta["example_value"] = tensor_meta(operand).to(BF16)
    _copy_provenance(node, before)
    return node


def erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase `node` and, in turn, the views and casts feeding it that nothing else reads (a BF16 copy the rewrite
    no longer reads)."""
    while isinstance(node, fx.Node) and not node.users and node.op in ("call_function", "call_method") \
            and (op_short_name(node) in _VIEWS or _is_bf16_cast(node)):
        source = node.args[0]
        graph.erase_node(node)
        node = source
