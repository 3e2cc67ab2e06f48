"""Graph helpers shared by the passes: what a node is, where it came from, what it reaches.

Passes run on the Dynamo graph (torch-level targets, FakeTensor values in
`node.meta["example_value"]`). These helpers read that graph; they never mutate it except
through `replace_node` and `insert_call`, which keep the metadata the report and later passes rely on.
Data flow here includes in-place writes: `buf[i] = v` makes `buf` depend on `v`.
"""

from __future__ import annotations

import fnmatch
import operator
from collections import Counter, deque
from collections.abc import Callable, Iterable

import networkx as nx
import torch
import torch.nn.functional as F
from torch import fx

from ..op_registry import gemm_role

_LINEAR_TARGETS = {torch._C._nn.linear, F.linear, torch.ops.aten.linear, torch.ops.aten.linear.default}
_MATMUL_TARGETS = {torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.ops.aten.mm, torch.ops.aten.mm.default,
                   torch.ops.aten.matmul, torch.ops.aten.matmul.default}
_GROUPED_MM_TARGETS = {torch._grouped_mm, torch.ops.aten._grouped_mm, torch.ops.aten._grouped_mm.default}
if hasattr(F, "grouped_mm"):  # torch >= 2.10 exposes a public alias
    _GROUPED_MM_TARGETS.add(F.grouped_mm)
_SDPA_TARGETS = {F.scaled_dot_product_attention}
_EINSUM_TARGETS = {torch.einsum, torch.functional.einsum, torch.ops.aten.einsum, torch.ops.aten.einsum.default}
_ADDMM_TARGETS = {torch.addmm, torch.ops.aten.addmm, torch.ops.aten.addmm.default}
_BATCHED_MM_TARGETS = {torch.bmm, torch.baddbmm, torch.ops.aten.bmm, torch.ops.aten.bmm.default,
                       torch.ops.aten.baddbmm, torch.ops.aten.baddbmm.default}


def example_value(node: fx.Node):
    """The FakeTensor (or value) Dynamo recorded for a node, if any."""
    return node.meta.get("example_value", node.meta.get("val"))


def static_int(size) -> int | None:
    """A size as a Python int when it is one or the shape environment pins it to one (e.g. bincount's
    unbacked length after a view fixes it), else None. Never adds a guard."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    shape_env = getattr(node, "shape_env", None)
    if shape_env is None:
        return None
    try:
        value = shape_env.replace(node.expr)
    except Exception:  # noqa: BLE001  (an expression the shape env cannot simplify is simply not static)
        return None
    return int(value) if getattr(value, "is_Integer", False) else None


def example_int(size) -> int | None:
    """A size as an int: static, or a backed symbol's example value; None when data dependent (unbacked)."""
    value = static_int(size)
    if value is not None:
        return value
    hint = getattr(getattr(size, "node", None), "hint", None)
    return None if hint is None else int(hint)


def static_shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    """The tensor's shape as ints, or None when any size is symbolic."""
    if t is None:
        return None
    sizes = tuple(static_int(s) for s in t.shape)
    return None if any(s is None for s in sizes) else sizes


def tensor_meta(node) -> torch.Tensor | None:
    if not isinstance(node, fx.Node):
        return None
    v = example_value(node)
    return v if isinstance(v, torch.Tensor) else None


def matches_any(path: str, patterns: Iterable[str]) -> str | None:
    """The first glob pattern that matches `path`, or None."""
    for p in patterns:
        if fnmatch.fnmatchcase(path, p):
            return p
    return None


def op_short_name(node: fx.Node) -> str:
    """`topk` for `x.topk(...)`, `torch.topk`, `aten.topk.default` alike; `getitem`, `mod` for operators;
    the node kind (`placeholder`, `get_attr`, ...) for a node that calls nothing."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return node.op
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._opname
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", str(t))


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
    if isinstance(t, torch._ops.HigherOrderOperator):
        return t.name()
    return getattr(t, "__name__", str(t))


def op_histogram(gm: fx.GraphModule) -> Counter:
    """Ops of the graph and of the HOP bodies passes rewrite (activation checkpoint bodies, ...)."""
    from moepass.analysis.scopes import graph_scopes

    return Counter(op_name(n) for scope in graph_scopes(gm) for n in scope.graph.nodes
                   if n.op in ("call_function", "call_method", "call_module"))


def is_call(node: fx.Node, targets) -> bool:
    return node.op == "call_function" and node.target in targets


_MULS = {operator.mul, torch.mul, torch.Tensor.mul, "mul"}


def is_mul(node: fx.Node) -> bool:
    """An elementwise product, as models spell it: `a * b`, `torch.mul`, `a.mul(b)`."""
    return node.op in ("call_function", "call_method") and node.target in _MULS


def is_linear(node: fx.Node) -> bool:
    return is_call(node, _LINEAR_TARGETS)


def is_matmul(node: fx.Node) -> bool:
    return is_call(node, _MATMUL_TARGETS) or (node.op == "call_method" and node.target in ("matmul", "mm", "__matmul__"))


def is_einsum(node: fx.Node) -> bool:
    return is_call(node, _EINSUM_TARGETS)


def is_addmm(node: fx.Node) -> bool:
    return is_call(node, _ADDMM_TARGETS) or (node.op == "call_method" and node.target == "addmm")


def is_batched_mm(node: fx.Node) -> bool:
    """bmm / baddbmm: a product per batch entry (per expert or head)."""
    return is_call(node, _BATCHED_MM_TARGETS) or (node.op == "call_method" and node.target in ("bmm", "baddbmm"))


def is_grouped_mm(node: fx.Node) -> bool:
    return is_call(node, _GROUPED_MM_TARGETS)


def is_gemm(node: fx.Node) -> bool:
    """Any node that does a matrix product (including ones moepass already rewrote)."""
    if is_linear(node) or is_matmul(node) or is_grouped_mm(node) or is_call(node, _SDPA_TARGETS) \
            or is_einsum(node) or is_addmm(node) or is_batched_mm(node):
        return True
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and gemm_role(node.target) is not None


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


def insert_call(graph: fx.Graph, target, args: tuple, value, like: fx.Node) -> fx.Node:
    """A new `target(*args)` at the graph's insertion point, holding `value` and `like`'s provenance."""
    node = graph.call_function(target, args)
    node.meta["example_value"] = value
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


# ---------------------------------------------------------------- data flow with in-place writes


def is_guard(node: fx.Node) -> bool:
    """A runtime check (`_assert_scalar`, `_assert_tensor_metadata`, ...): needed only while what it checks is."""
    if node.op != "call_function":
        return False
    t = node.target
    return t in _GUARDS or (isinstance(t, torch._ops.OpOverload) and "assert" in t._opname)


def _ops(namespace: str, name: str) -> set:
    ns = getattr(torch.ops, namespace, None)
    packet = getattr(ns, name, None) if ns is not None else None
    return {packet, packet.default} if packet is not None else set()


_GUARDS = (_ops("aten", "_assert_scalar") | _ops("aten", "sym_constrain_range_for_size")
           | _ops("aten", "sym_constrain_range") | _ops("aten", "_assert_async")
           | {torch._check, torch._check_is_size})


def written_buffer(node: fx.Node) -> fx.Node | None:
    """The tensor an in-place node writes into (`buf[i] = v`, `buf.copy_(v)`, `buf.index_add_(...)`)."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.setitem:
        return first
    if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_") \
            and node.target != "requires_grad_":
        return first
    if node.op == "call_function" and node.target in _INPLACE_FUNCTIONS:
        return first
    return None


_INPLACE_FUNCTIONS = {torch.Tensor.index_add_, torch.Tensor.scatter_, torch.Tensor.scatter_add_,
                      torch.Tensor.index_put_, torch.Tensor.copy_, torch.Tensor.index_copy_}


def data_inputs(node: fx.Node) -> list[fx.Node]:
    """What a node's value depends on: its inputs, and for a buffer the in-place writes into it."""
    return list(node.all_input_nodes) + [u for u in node.users if written_buffer(u) is node]


def data_users(node: fx.Node) -> list[fx.Node]:
    """Nodes whose value depends on this one; a write makes the buffer written into depend on it too."""
    users = list(node.users)
    buffer = written_buffer(node)
    return users + ([buffer] if buffer is not None else [])


def ancestors(node: fx.Node, stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """Every node `node` depends on, not expanding past `stop` (which are included)."""
    stop, seen, frontier = set(stop), set(), [node]
    while frontier:
        for a in data_inputs(frontier.pop()):
            if a not in seen:
                seen.add(a)
                if a not in stop:
                    frontier.append(a)
    return seen


def between(sources: Iterable[fx.Node], target: fx.Node, stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
    """Nodes on a data path from any source to target, ends included; the backward walk stops at `stop`."""
    sources = set(sources)
    upstream = ancestors(target, stop=set(stop) | sources) | {target}
    reached = {s for s in sources if s in upstream}
    frontier = list(reached)
    while frontier:
        for u in data_users(frontier.pop()):
            if u in upstream and u not in reached:
                reached.add(u)
                frontier.append(u)
    return reached


def later_values(start: fx.Node, after: fx.Node, accept: Callable[[fx.Node], bool], limit: int) -> list[fx.Node]:
    """The first `limit` accepted values computed from `start`, scanning the graph forward from `after`."""
    reached, found, scanning = {start}, [], False
    for n in after.graph.nodes:
        scanning = scanning or n is after
        if not scanning or n.op == "output" or not any(a in reached for a in n.all_input_nodes):
            continue
        reached.add(n)
        if (buffer := written_buffer(n)) is not None:
            reached.add(buffer)
        if accept(n):
            found.append(n)
            if len(found) == limit:
                break
    return found


def nearest_ancestors(start: fx.Node, accept: Callable[[fx.Node], bool], stop: Iterable[fx.Node] = ()) -> list[fx.Node]:
    """Breadth-first from `start` backwards: the first accepted node on every path (not expanded further)."""
    stop, seen, found = set(stop), {start}, []
    queue = deque(data_inputs(start))
    while queue:
        n = queue.popleft()
        if n in seen:
            continue
        seen.add(n)
        if accept(n):
            found.append(n)
        elif n not in stop:
            queue.extend(data_inputs(n))
    return found


def is_unused(node: fx.Node) -> bool:
    """Nothing reads the node's value: no users but unused ones, and no side effects (Dynamo keeps dead
    `x.size()` reads in HOP bodies)."""
    if node.op in ("output", "placeholder") or written_buffer(node) is not None:
        return False
    if node.op == "call_function" and node.is_impure():
        return False
    return all(is_unused(u) for u in node.users)


def graph_order(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in graph order (computed afresh: callers may have edited the graph)."""
    return {n: i for i, n in enumerate(graph.nodes)}
