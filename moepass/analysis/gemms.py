"""GEMM nodes of a Dynamo graph and its HOP bodies, and which of a GEMM's operands is a weight (a parameter).

A GEMM is any matrix product torch or moepass spells: linear, matmul / `@`, mm, bmm, baddbmm, addmm, addbmm, einsum,
torch._grouped_mm, torch._scaled_mm, SDPA (attention's two products), or a moepass GEMM op (moepass.op_registry).
An operand is a weight when it is a parameter read through views, casts, slices (`W[e]`), stacks and shard gathers,
across the boundaries of HOP bodies (activation checkpoint, autograd.Function forward); everything else (attention's
`q @ k.T`) is an activation. Bodies passes do not enter (cond, map) are walked too: what their inputs are is unknown.
"""

from __future__ import annotations

import operator
import re

import torch
from torch import fx, nn

from moepass.analysis.graph import example_value, op_short_name, is_grouped_mm, is_linear, is_matmul, tensor_meta
from moepass.op_registry import gemm_role, is_rows_form

from .scopes import Scope, graph_scopes, hop_name, operand_index

# products graph.py's is_linear / is_matmul / is_grouped_mm do not name
_EXTRA_GEMMS = {torch.baddbmm, torch.addmm, torch.addbmm, torch.einsum, torch.functional.einsum,
                torch.ops.aten.bmm, torch.ops.aten.bmm.default, torch.ops.aten.baddbmm, torch.ops.aten.baddbmm.default,
                torch.ops.aten.addmm, torch.ops.aten.addmm.default, torch.ops.aten.einsum,
                torch.ops.aten.einsum.default}
_EXTRA_METHODS = {"bmm", "baddbmm", "addmm", "addbmm", "__rmatmul__"}
_ADDING = {"baddbmm", "addmm", "addbmm"}  # (input, a, b): the product is of args 1 and 2
# GEMMs on FP8 operands the user (or torchao) already wrote: low precision, not moepass's
_SCALED = {torch._scaled_mm, torch.ops.aten._scaled_mm, torch.ops.aten._scaled_mm.default}
if hasattr(torch, "_scaled_grouped_mm"):
    _SCALED |= {torch._scaled_grouped_mm, torch.ops.aten._scaled_grouped_mm,
                torch.ops.aten._scaled_grouped_mm.default}
_SDPA = {torch.nn.functional.scaled_dot_product_attention}
# ops a weight passes through on its way to a GEMM unchanged but for layout, dtype, a slice or a gather of shards
_WEIGHT_VIEWS = {"view", "reshape", "t", "transpose", "permute", "contiguous", "to", "type", "float", "half",
                 "bfloat16", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "narrow",
                 "select", "getitem", "__getitem__", "chunk", "split", "unbind", "clone", "detach", "index_select",
                 "view_as", "reshape_as", "movedim", "swapaxes", "swapdims", "repeat", "stack", "cat", "T", "mT",
                 "to_local", "redistribute", "full_tensor", "from_local", "wait_tensor", "all_gather_into_tensor",
                 "_to_copy", "alias", "_unsafe_view"}


def gemm_kind(node: fx.Node) -> str | None:
    """"moepass", "scaled", "sdpa" or "torch" for a GEMM node (a forward GEMM: moepass's dgrad/wgrad ops are the
    backward of one), None for anything else."""
    if node.op == "call_function":
        role = gemm_role(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
        if role is not None:
            return "moepass" if role.gemm == "forward" else None
        if isinstance(node.target, torch._ops.OpOverload) and is_rows_form(node.target):
            return "moepass"  # quantize_once's grouped forward on rows quantized before their gather or dispatch
        if node.target in _SCALED:
            return "scaled"
        if node.target in _SDPA:
            return "sdpa"
    if is_linear(node) or is_matmul(node) or is_grouped_mm(node):
        return "torch"
    if (node.op == "call_function" and node.target in _EXTRA_GEMMS) or \
            (node.op == "call_method" and node.target in _EXTRA_METHODS):
        return "torch"
    return None


def gemm_operands(node: fx.Node) -> list[fx.Node]:
    """The two (or more) tensors a GEMM multiplies, in order: not the added input of addmm/baddbmm, not offsets."""
    if gemm_kind(node) == "sdpa":  # query, key, value
        return [a for a in [*node.args[:3], *(node.kwargs.get(k) for k in ("query", "key", "value"))]
                if tensor_meta(a) is not None]
    if op_short_name(node) == "einsum":
        rest = node.args[1:]
        rest = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        return [a for a in rest if isinstance(a, fx.Node)]
    args = list(node.args)
    if op_short_name(node) in _ADDING:
        args = args[1:3]
    elif gemm_kind(node) in ("torch", "scaled"):
        args = args[:2] + [v for k, v in node.kwargs.items() if k in ("weight", "mat2", "mat_b", "other")]
    # a moepass op or an opaque call: every tensor argument, the activation first
    return [a for a in args if tensor_meta(a) is not None]


class Scopes:
    """The graph's scopes, entered (passes rewrite inside them) or not (cond, map: passes do not see them)."""

    def __init__(self, gm: fx.GraphModule):
        self.entered = graph_scopes(gm)
        self.unentered: list[Scope] = []
        seen, frontier = {id(s.gm) for s in self.entered}, list(self.entered)
        while frontier:  # an unentered body may hold more (a cond inside a cond)
            scope = frontier.pop(0)
            for node in scope.graph.nodes:
                if not hop_name(node):
                    continue
                for arg in node.args:
                    body = getattr(scope.gm, arg.target, None) if isinstance(arg, fx.Node) and \
                        arg.op == "get_attr" else None
                    if isinstance(body, fx.GraphModule) and id(body) not in seen:
                        seen.add(id(body))
                        name = f"{scope.name}.{arg.target}" if scope.name else arg.target
                        self.unentered.append(Scope(body, name, hop_name(node), scope, [node]))
                        frontier.append(self.unentered[-1])
        self.of_graph = {id(s.graph): s for s in (*self.entered, *self.unentered)}

    def runs(self, scope: Scope) -> int:
        """How often a body runs per call of the top graph (a nested compile region called per layer)."""
        count = 1
        while scope.parent is not None:
            count *= max(1, len(scope.calls))
            scope = scope.parent
        return count


MAYBE = object()  # a body input whose operand moepass cannot see (an unentered HOP body): could be a weight


def _is_parameter(node: fx.Node) -> bool:
    """A placeholder Dynamo lifted from a module's parameter, or a get_attr of one."""
    if node.op == "get_attr":
        owner = node.graph.owning_module
        try:
            return isinstance(operator.attrgetter(node.target)(owner), nn.Parameter)
        except AttributeError:
            return False
    if isinstance(example_value(node), nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    return "_parameters" in str(getattr(source, "name", ""))


def parameter_name(node: fx.Node) -> str:
    """The parameter's own name ("w1", "weight"), from the source Dynamo recorded for it."""
    source = str(getattr(getattr(node.meta.get("grapharg"), "source", None), "name", ""))
    found = re.findall(r"\[['\"]([^'\"\]]+)['\"]\]", source)
    if found:
        return found[-1]
    if node.op == "get_attr":
        return node.target.rsplit(".", 1)[-1]
    found = re.findall(r"_parameters_(\w+?)_?$", node.name)
    return found[-1] if found else node.name


def weight_source(start: fx.Node, scopes: Scopes):
    """The parameter placeholder a GEMM operand reads, through views, casts, slices and shard gathers (across HOP
    body boundaries); MAYBE where the walk reaches an input it cannot follow; None for an activation."""
    seen, frontier = set(), [start]
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op in ("placeholder", "get_attr"):
            if _is_parameter(node):
                return node
            if node.op == "placeholder":
                outer = _body_operands(node, scopes)
                if outer is MAYBE:
                    return MAYBE
                frontier += outer
            continue
        if node.op == "call_function" and node.target is operator.getitem and hop_name(node.args[0]):
            frontier += _body_results(node, scopes)
            continue
        if (op_short_name(node) in _WEIGHT_VIEWS) or (node.op == "call_function" and node.target is getattr):
            first = node.args[0] if node.args else None
            for arg in first if isinstance(first, (list, tuple)) else [first]:
                if isinstance(arg, fx.Node):
                    frontier.append(arg)
    return None


def _body_operands(placeholder: fx.Node, scopes: Scopes):
    """What the calls of the body pass for `placeholder` ([] at the top graph; MAYBE when not known)."""
    scope = scopes.of_graph.get(id(placeholder.graph))
    if scope is None or scope.parent is None:
        return []
    if scope not in scopes.entered or scope.kind.endswith("backward"):
        return MAYBE
    placeholders = [n for n in scope.graph.nodes if n.op == "placeholder"]
    found = []
    for call in scope.calls:
        operands = call.args[operand_index(scope):]
        shift = len(placeholders) - len(operands)  # an autograd.Function forward may take ctx first
        i = placeholders.index(placeholder) - max(0, shift)
        if not 0 <= i < len(operands):
            return MAYBE
        if isinstance(operands[i], fx.Node):
            found.append(operands[i])
    return found


def _body_results(getitem: fx.Node, scopes: Scopes) -> list[fx.Node]:
    call, index = getitem.args
    for scope in (*scopes.entered, *scopes.unentered):
        if call in scope.calls:
            (output,) = [n for n in scope.graph.nodes if n.op == "output"]
            results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
            if isinstance(index, int) and index < len(results) and isinstance(results[index], fx.Node):
                return [results[index]]
    return []
