"""Graph helpers shared by the passes: what a node is, where it came from, what it reaches.

Passes run on the Dynamo graph (torch-level targets, FakeTensor values in
`node.meta["example_value"]`). These helpers read that graph; they never mutate it except
through `replace_node`, which keeps the metadata the report and later passes rely on.
"""

from __future__ import annotations

import fnmatch
import operator
import re
from collections import Counter
from collections.abc import Iterable

import networkx as nx
import torch
import torch.nn.functional as F
from torch import fx

_LINEAR_TARGETS = {torch._C._nn.linear, F.linear, torch.ops.aten.linear, torch.ops.aten.linear.default}
_MATMUL_TARGETS = {torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.ops.aten.mm, torch.ops.aten.mm.default,
                   torch.ops.aten.matmul, torch.ops.aten.matmul.default}
_GROUPED_MM_TARGETS = {torch._grouped_mm, torch.ops.aten._grouped_mm, torch.ops.aten._grouped_mm.default}
if hasattr(F, "grouped_mm"):  # torch >= 2.10 exposes a public alias
    _GROUPED_MM_TARGETS.add(F.grouped_mm)
_SDPA_TARGETS = {F.scaled_dot_product_attention}


def example_value(node: fx.Node):
    """The FakeTensor (or value) Dynamo recorded for a node, if any."""
    return node.meta.get("example_value", node.meta.get("val"))


def tensor_meta(node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    v = example_value(node)
    return v if isinstance(v, torch.Tensor) else None


_PATH_PREFIX = re.compile(r"^L\[['\"][^'\"]+['\"]\]\.?")


def normalize_module_path(raw: str) -> str:
    """`L['self'].layers[0].attention.wq` -> `layers.0.attention.wq` (the state_dict spelling)."""
    path = _PATH_PREFIX.sub("", raw)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    path = path.replace("._orig_mod", "").removeprefix("_orig_mod").lstrip(".")
    return path


def module_path(node: fx.Node) -> str:
    """Module path of the innermost nn.Module that issued the node ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1][0]
    return normalize_module_path(raw)


def module_type(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    t = list(stack.values())[-1][1]
    return getattr(t, "__qualname__", str(t))


def matches_any(path: str, patterns: Iterable[str]) -> str | None:
    """The first glob pattern that matches `path`, or None."""
    for p in patterns:
        if fnmatch.fnmatchcase(path, p):
            return p
    return None


def op_name(node: fx.Node) -> str:
    """A short readable name for histograms: `linear`, `_grouped_mm`, `Tensor.view`, `moepass.mxfp8_linear`."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module:{node.target}"
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(t)
        return name.removeprefix("torch.ops.").removesuffix(".default")
    return getattr(t, "__name__", str(t))


def op_histogram(gm: fx.GraphModule) -> Counter:
    return Counter(op_name(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))


def is_call(node: fx.Node, targets) -> bool:
    return node.op == "call_function" and node.target in targets


def is_linear(node: fx.Node) -> bool:
    return is_call(node, _LINEAR_TARGETS)


def is_matmul(node: fx.Node) -> bool:
    return is_call(node, _MATMUL_TARGETS) or (node.op == "call_method" and node.target in ("matmul", "mm", "__matmul__"))


def is_grouped_mm(node: fx.Node) -> bool:
    return is_call(node, _GROUPED_MM_TARGETS)


def is_gemm(node: fx.Node) -> bool:
    """Any node that does a matrix product (including ones moepass already rewrote)."""
    if is_linear(node) or is_matmul(node) or is_grouped_mm(node) or is_call(node, _SDPA_TARGETS):
        return True
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t.namespace == "moepass" \
        and ("linear" in t._opname or "grouped_mm" in t._opname)


def to_networkx(graph: fx.Graph) -> nx.DiGraph:
    """Data-flow graph: an edge producer -> user for every use."""
    g = nx.DiGraph()
    for n in graph.nodes:
        g.add_node(n)
        for u in n.users:
            g.add_edge(n, u)
    return g


def reaches(g: nx.DiGraph, start: fx.Node, stop_at=lambda n: False) -> set[fx.Node]:
    """Nodes reachable from `start` along data flow, not expanding past nodes where `stop_at` holds."""
    seen, frontier = set(), [start]
    while frontier:
        n = frontier.pop()
        for u in g.successors(n):
            if u in seen:
                continue
            seen.add(u)
            if not stop_at(u):
                frontier.append(u)
    return seen


def node_arg(node: fx.Node, index: int, name: str, default=None):
    """Argument by position or keyword, as Dynamo may record either."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def replace_node(graph: fx.Graph, node: fx.Node, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Put `target(*args)` in place of `node`, keeping its value and provenance metadata."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs or {})
    for key in ("example_value", "val", "nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr"):
        if key in node.meta:
            new.meta[key] = node.meta[key]
    new.meta["moepass_replaced"] = node.name
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new
