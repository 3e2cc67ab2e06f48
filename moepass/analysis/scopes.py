"""Higher-order-op bodies: the graphs Dynamo nests inside one compiled graph.

Activation checkpointing (`torch.utils.checkpoint`, `checkpoint_wrapper`, torchtitan's full and
selective AC) puts a block's ops inside `tag_activation_checkpoint(body, *operands)`; `wrap` and
`invoke_subgraph` do the same for other reasons, and an `autograd.Function` becomes
`autograd_function_apply(forward_body, backward_body, *operands)`. Each body is a GraphModule
attribute of its parent, with FakeTensor values and module paths on its nodes like the top graph.
A pass that walks only the top graph sees none of their GEMMs, so passes iterate `graph_scopes`.
"""

from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
from torch import fx

_HOP = torch._ops.HigherOrderOperator
# HOPs whose bodies are plain data flow run once per call: passes rewrite inside them as at the top level.
# name -> (indices of body arguments, index of the first operand)
_ENTERED = {
    "tag_activation_checkpoint": ((0,), 1),
    "wrap": ((0,), 1),
    "wrap_with_set_grad_enabled": ((1,), 2),
    "wrap_with_autocast": ((4,), 5),
    "invoke_subgraph": ((0,), 2),
    "autograd_function_apply": ((0, 1), 2),
}
_KIND = {
    "tag_activation_checkpoint": "activation checkpoint",
    "autograd_function_apply": "autograd.Function",
    "invoke_subgraph": "nested compile region",
}


@dataclasses.dataclass(eq=False)
class Scope:
    """One graph: the top-level Dynamo graph, or a HOP body inside it."""

    gm: fx.GraphModule
    name: str  # "" at top level, else the body's attribute path from the top graph ("wrap_body_0")
    kind: str  # "top", "activation checkpoint", "autograd.Function forward", ...
    parent: Scope | None = None
    calls: list[fx.Node] = dataclasses.field(default_factory=list)  # HOP nodes in the parent that run this body

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def qualified(self, node_name: str) -> str:
        """A node's name unique across scopes, as reports print it."""
        return f"{self.name}/{node_name}" if self.name else node_name


def hop_name(node: fx.Node) -> str | None:
    if node.op == "call_function" and isinstance(node.target, _HOP):
        return node.target.name() if callable(getattr(node.target, "name", None)) else str(node.target)
    return None


def body_modules(parent: fx.GraphModule, node: fx.Node) -> list[tuple[int, fx.GraphModule]]:
    """(argument index, body) of every body a HOP call that passes enter runs."""
    entry = _ENTERED.get(hop_name(node) or "")
    if entry is None:
        return []
    found = []
    for i in entry[0]:
        arg = node.args[i] if len(node.args) > i else None
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            body = getattr(parent, arg.target, None)
            if isinstance(body, fx.GraphModule):
                found.append((i, body))
    return found


def graph_scopes(gm: fx.GraphModule) -> list[Scope]:
    """The top graph, then every entered HOP body (recursively), each body once however often it is called."""
    top = Scope(gm, "", "top")
    scopes, by_body, frontier = [top], {id(gm): top}, [top]
    while frontier:
        scope = frontier.pop(0)
        for node in scope.graph.nodes:
            for i, body in body_modules(scope.gm, node):
                if id(body) in by_body:
                    by_body[id(body)].calls.append(node)
                    continue
                hop = hop_name(node)
                kind = _KIND.get(hop, hop)
                if hop == "autograd_function_apply":
                    kind += " forward" if i == 0 else " backward"
                name = node.args[i].target if not scope.name else f"{scope.name}.{node.args[i].target}"
                child = Scope(body, name, kind, scope, [node])
                by_body[id(body)] = child
                scopes.append(child)
                frontier.append(child)
    return scopes


def operand_index(scope: Scope) -> int:
    """Index in a call's args of the operand bound to the body's first placeholder."""
    return _ENTERED[hop_name(scope.calls[0])][1]


def dataflow(scopes: list[Scope]) -> nx.DiGraph:
    """Data flow across scopes: producer -> user inside each graph, a HOP operand -> the body's placeholder,
    and a body's i-th output -> the parent's `getitem(call, i)` (so walks continue through a body's boundary)."""
    g = nx.DiGraph()
    for scope in scopes:
        for n in scope.graph.nodes:
            g.add_node(n)
            for u in n.users:
                g.add_edge(n, u)
        if scope.parent is None or not scope.kind.startswith(("activation", "wrap", "nested")):
            continue  # an autograd.Function's bodies are not called with the apply's operands one to one
        placeholders = [n for n in scope.graph.nodes if n.op == "placeholder"]
        (output,) = [n for n in scope.graph.nodes if n.op == "output"]
        results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        for call in scope.calls:
            operands = call.args[operand_index(scope):]
            for operand, placeholder in zip(operands, placeholders):
                if isinstance(operand, fx.Node):
                    g.add_edge(operand, placeholder)
            for user in call.users:
                if user.op == "call_function" and user.target is operator.getitem \
                        and isinstance(user.args[1], int) and user.args[1] < len(results) \
                        and isinstance(results[user.args[1]], fx.Node):
                    g.add_edge(results[user.args[1]], user)
    return g
