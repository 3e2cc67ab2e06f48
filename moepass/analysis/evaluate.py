"""Run a slice of a Dynamo graph on concrete values: how index arithmetic is checked instead of matched.

`evaluate(gm, outputs, leaves)` computes `outputs` from values given for `leaves`, executing only
the nodes in between (with the in-place writes they see). A slice that needs anything else (a graph
input, a collective, a module call) is `NotEvaluable`. Inputs read only for their metadata
(`zeros_like(scores)`, `x.new_empty(...)`, `x.size(0)`) get an uninitialised stand-in of the recorded
shape, so a buffer shaped like an activation does not drag the activation's producers into the slice.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch import fx
from torch.fx.node import map_arg

from moepass.analysis.graph import graph_order, tensor_meta, written_buffer
from .collectives import is_autograd_function, is_collective
from .dtensors import communication, is_local_view
from .symbols import bound_symint, concrete_shape

_LIKE_FUNCTIONS = {torch.zeros_like, torch.empty_like, torch.ones_like, torch.full_like, torch.rand_like,
                   torch.randn_like}
_LIKE_METHODS = {"new_zeros", "new_empty", "new_ones", "new_full", "new_tensor", "size", "dim", "numel"}
_METADATA_FUNCTIONS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default}


class NotEvaluable(Exception):
    """A subgraph that cannot be computed from the given leaves alone."""


_LIKE_OTHER_METHODS = {"reshape_as", "view_as", "expand_as", "type_as"}  # read the *other* tensor's metadata


def reads_only_metadata(user: fx.Node, producer: fx.Node) -> bool:
    """`user` needs `producer` only for its shape, dtype and device."""
    if user.op == "call_method" and user.target in _LIKE_OTHER_METHODS and len(user.args) == 2 \
            and user.args[1] is producer and user.args[0] is not producer:
        return True
    if not user.args or user.args[0] is not producer or producer in user.args[1:] \
            or producer in user.kwargs.values():
        return False
    if user.op == "call_method":
        return user.target in _LIKE_METHODS
    if user.op == "call_function":
        if user.target in _LIKE_FUNCTIONS or user.target in _METADATA_FUNCTIONS:
            return True
        return user.target is getattr and user.args[1] in ("shape", "dtype", "device")
    return False


def _stand_in(node: fx.Node, device, symbols: dict) -> torch.Tensor:
    t = tensor_meta(node)
    return torch.empty(concrete_shape(node, symbols), dtype=t.dtype, device=device if device is not None else t.device)


def backward_slice(outputs: list[fx.Node], leaves: Iterable[fx.Node], forbidden: Iterable[fx.Node] = (),
                   observe_at: fx.Node | None = None, symbols: dict | None = None
                   ) -> tuple[list[fx.Node], set[fx.Node]]:
    """(nodes in graph order that compute `outputs` from `leaves`, nodes needed only for their metadata).

    Values are taken as seen by `observe_at` (default: the last output): in-place writes into a buffer
    made before that point are part of its value, later ones are not. SymInt graph inputs (`s77`) are
    leaves too when `symbols` gives their value.
    """
    leaves, forbidden, symbols = set(leaves), set(forbidden), symbols or {}
    order = graph_order(outputs[0].graph)
    last = order[observe_at] if observe_at is not None else max(order[o] for o in outputs)
    needed, shape_only, frontier = set(), set(), list(outputs)
    while frontier:
        n = frontier.pop()
        if n in needed or n in leaves:
            continue
        if n in forbidden:
            raise NotEvaluable(f"depends on {n.name}")
        if n.op == "placeholder" and bound_symint(n, symbols) is not None:
            needed.add(n)
            continue
        if n.op in ("placeholder", "call_module") or is_collective(n) or is_autograd_function(n) \
                or isinstance(n.target, torch._ops.HigherOrderOperator):
            raise NotEvaluable(f"depends on {n.name} ({n.op} {n.target})")
        if (why := communication(n)) is not None:  # DTensors are evaluated on local shards (analysis.dtensors)
            raise NotEvaluable(why)
        needed.add(n)
        for a in n.all_input_nodes:
            if reads_only_metadata(n, a) and concrete_shape(a, symbols) is not None:
                shape_only.add(a)
            else:
                frontier.append(a)
        frontier.extend(u for u in n.users if written_buffer(u) is n and order[u] < last)
    return sorted(needed, key=order.__getitem__), shape_only - needed - leaves


def evaluate(gm: fx.GraphModule, outputs: list[fx.Node], leaf_values: dict, forbidden: Iterable[fx.Node] = (),
             observe_at: fx.Node | None = None, symbols: dict | None = None) -> list:
    """Run the slice of the graph that computes `outputs` (as `observe_at` sees them) from concrete leaf values,
    with the graph's size symbols bound to `symbols` (moepass.analysis.symbols)."""
    env, symbols = dict(leaf_values), symbols or {}
    nodes, shape_only = backward_slice(outputs, leaf_values, forbidden, observe_at, symbols)
    device = next((v.device for v in leaf_values.values() if isinstance(v, torch.Tensor)), None)
    for n in shape_only:
        env[n] = _stand_in(n, device, symbols)
    with torch.no_grad():
        for n in nodes:
            args, kwargs = map_arg((n.args, n.kwargs), env.__getitem__)
            try:
                if n.op == "placeholder":
                    value = bound_symint(n, symbols)
                elif is_local_view(n):
                    value = args[0]
                elif n.op == "get_attr":
                    value = operator.attrgetter(n.target)(gm)
                elif n.op == "call_method":
                    value = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    value = n.target(*args, **kwargs)
            except Exception as error:  # e.g. an index out of range: the sample does not fit the code's assumptions
                raise NotEvaluable(f"{n.name} raised {type(error).__name__}: {error}") from error
            env[n] = value
    return [env[o] for o in outputs]
