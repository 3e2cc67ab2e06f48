"""Integer tensors whose values provably lie in [0, n), read off how they were computed.

Indices chosen over one dim of static size n (topk, sort, max/min with a dim, argmax, argmin, argsort) lie in
[0, n); views, casts, selections (getitem, index_select, gather, split) keep the values they read; `x % n` and
`x.clamp(0, n - 1)` bound any integers; `x // d` divides a bound. Anything else (a graph input, an addition, a
tensor written in place) is not proven: `ids_bound` says None and where the proof stopped. No evaluation, no
guards: a structural fact about the graph, which the EP analysis uses to pin a bincount's length
(moepass.analysis.counts_length).
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
from torch import fx

from moepass.analysis.graph import example_value, node_arg, op_short_name, static_int, tensor_meta, written_buffer
from .dtensors import is_local_view, local_value

_MAX_STEPS = 64  # producers followed before giving up (chains of views and casts are short)


@dataclasses.dataclass(frozen=True)
class IdsBound:
    """Values lie in [0, limit) (limit None: not proven); `how` says why, or where the proof stopped."""

    limit: int | None
    how: str


# choices over one dim: name -> (position of the dim argument, its default); the indices are output 1 of the tuples
_INDEX_TUPLE_PRODUCERS = {"topk": (2, -1), "kthvalue": (2, -1), "sort": (1, -1), "mode": (1, -1), "max": (1, None),
                          "min": (1, None)}
_INDEX_PRODUCERS = {"argmax": (1, None), "argmin": (1, None), "argsort": (1, -1)}
# the output holds values read from args[0] (and nothing else)
_SAME_VALUES = {"view", "reshape", "flatten", "unflatten", "contiguous", "clone", "detach", "squeeze", "unsqueeze",
                "t", "transpose", "permute", "movedim", "expand", "expand_as", "view_as", "reshape_as", "repeat",
                "narrow", "select", "flip", "roll", "index_select", "gather", "take", "take_along_dim",
                "masked_select", "getitem", "_unsafe_view", "alias"}
_SPLITS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes"}  # indexed by getitem afterwards
_CASTS = {"to", "long", "int", "short", "float", "double", "half", "bfloat16", "type", "type_as", "_to_copy",
          "convert_element_type"}
_REMAINDERS = {"remainder", "mod", "__mod__"}
_FLOOR_DIVISIONS = {"floordiv", "floor_divide", "__floordiv__"}
_CLAMPS = {"clamp", "clip"}


def ids_bound(node) -> IdsBound:
    """Whether every value of the integer tensor `node` lies in [0, n) for a static n, proven from its producers."""
    return _bound(node, _MAX_STEPS)


def _unproven(node, what: str) -> IdsBound:
    name = node.name if isinstance(node, fx.Node) else repr(node)
    return IdsBound(None, f"{name} ({what})")


def _bound(node, steps: int) -> IdsBound:
    if not isinstance(node, fx.Node) or tensor_meta(node) is None:
        return _unproven(node, "not a tensor")
    if steps == 0:
        return _unproven(node, "too far from where the ids were chosen")
    if node.op == "placeholder":
        return _unproven(node, "a graph input")
    if node.op not in ("call_function", "call_method"):
        return _unproven(node, f"a {node.op}")
    writer = _written_in_place(node)
    if writer is not None:
        return _unproven(node, f"written in place by {writer.name}")
    name = op_short_name(node)
    source = node.args[0] if node.args else None

    if name == "getitem" and isinstance(source, fx.Node) and not isinstance(example_value(source), torch.Tensor):
        return _tuple_item(node, source, steps)
    if name in _INDEX_PRODUCERS:
        position, default = _INDEX_PRODUCERS[name]
        return _chosen_over(node, source, node_arg(node, position, "dim", default), name)
    if is_local_view(node) or name in _SAME_VALUES:  # a DTensor's local shard holds the DTensor's values
        return _bound(source, steps - 1)
    if name in _CASTS:
        return _cast(node, _bound(source, steps - 1))
    if name in _REMAINDERS:
        return _remainder(node, source, steps)
    if name in _FLOOR_DIVISIONS or (name == "div" and node.kwargs.get("rounding_mode") in ("floor", "trunc")):
        return _floor_division(node, source, steps)
    if name in _CLAMPS:
        return _clamp(node, source, steps)
    return _unproven(node, f"{name}, which does not bound its values")


def _tuple_item(node: fx.Node, producer: fx.Node, steps: int) -> IdsBound:
    """`topk(...)[1]`, `sort(...)[1]`, `max(x, dim)[1]`: indices; `split(ids, ...)[i]`: values of the split tensor."""
    name, item = op_short_name(producer), node.args[1]
    if name in _SPLITS:
        return _bound(producer.args[0], steps - 1)
    if name in _INDEX_TUPLE_PRODUCERS and item == 1:
        position, default = _INDEX_TUPLE_PRODUCERS[name]
        dim = node_arg(producer, position, "dim", default)
        if name in ("max", "min") and dim is None:
            return _unproven(node, f"{name} without a dim")
        return _chosen_over(node, producer.args[0], dim, name)
    return _unproven(node, f"output {item} of {name} {producer.name}")


def _chosen_over(node: fx.Node, scores, dim, name: str) -> IdsBound:
    """Indices into `scores` along `dim` (None: into the flattened tensor)."""
    t = local_value(tensor_meta(scores))
    if t is None or not isinstance(dim, (int, type(None))):
        return _unproven(node, f"{name} over an unknown dim")
    size = static_int(t.numel()) if dim is None else (static_int(t.shape[dim]) if t.dim() else 1)
    if size is None:
        return _unproven(node, f"{name} over a dim of data-dependent or symbolic size")
    where = "all elements" if dim is None else f"dim {dim} of size {size}"
    return IdsBound(size, f"{name} indices over {where} ({node.name})")


def _cast(node: fx.Node, inner: IdsBound) -> IdsBound:
    """Integers below `limit` survive a cast to a dtype that holds them exactly."""
    if inner.limit is None:
        return inner
    dtype = tensor_meta(node).dtype
    if dtype.is_floating_point:
        exact = inner.limit <= 2 / torch.finfo(dtype).eps  # every integer up to 2**(mantissa bits + 1)
    else:
        exact = dtype != torch.bool and not dtype.is_complex and inner.limit - 1 <= torch.iinfo(dtype).max
    return inner if exact else _unproven(node, f"a cast to {dtype} that does not hold every value below {inner.limit}")


def _positive_int(value) -> int | None:
    value = static_int(value) if not isinstance(value, bool) else None
    return value if value is not None and value > 0 else None


def _remainder(node: fx.Node, source, steps: int) -> IdsBound:
    divisor = _positive_int(node.args[1] if len(node.args) > 1 else node.kwargs.get("other"))
    if divisor is None or not _is_integer(node):
        return _unproven(node, "a remainder by something other than a positive integer")
    inner = _bound(source, steps - 1)  # a tighter bound of the dividend survives
    limit = divisor if inner.limit is None else min(divisor, inner.limit)
    return IdsBound(limit, f"{node.name} (a remainder by {divisor})")


def _floor_division(node: fx.Node, source, steps: int) -> IdsBound:
    divisor = _positive_int(node.args[1] if len(node.args) > 1 else node.kwargs.get("other"))
    inner = _bound(source, steps - 1)
    if divisor is None or not _is_integer(node) or inner.limit is None:
        return inner if inner.limit is None else _unproven(node, "a division by something other than a positive "
                                                                 "integer")
    return IdsBound(math.ceil(inner.limit / divisor), f"{node.name} ({inner.how}, divided by {divisor})")


def _clamp(node: fx.Node, source, steps: int) -> IdsBound:
    low, high = node_arg(node, 1, "min"), node_arg(node, 2, "max")
    high = static_int(high) if isinstance(high, int) and not isinstance(high, bool) else None
    if high is None or high < 0 or not _is_integer(node):
        return _unproven(node, "a clamp without an integer max >= 0")
    inner = _bound(source, steps - 1)
    if isinstance(low, int) and not isinstance(low, bool) and low >= 0:
        limit = high + 1 if inner.limit is None else min(high + 1, max(inner.limit, low + 1))
        return IdsBound(limit, f"{node.name} (clamped to [{low}, {high}])")
    if inner.limit is not None:  # no lower clamp: the values were already >= 0
        return IdsBound(min(high + 1, inner.limit), f"{node.name} ({inner.how}, clamped to at most {high})")
    return _unproven(node, "a clamp without an integer min >= 0 of values not known to be >= 0")


def _is_integer(node: fx.Node) -> bool:
    t = tensor_meta(node)
    return t is not None and not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool


# ops whose output may share storage with their input: a write through any of them changes the input's values
_ALIASING = (_SAME_VALUES - {"clone", "index_select", "gather", "take", "take_along_dim", "masked_select", "repeat"}
             ) | _SPLITS | _CASTS


def _written_in_place(node: fx.Node) -> fx.Node | None:
    """A node that writes into `node` or a view of it (`ids[mask] = E`, `flat.clamp_(...)`), if any."""
    seen, frontier = {node}, [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if written_buffer(u) is n or (u.op == "call_function" and u.target is operator.setitem and u.args[0] is n):
                return u
            if u not in seen and (is_local_view(u) or op_short_name(u) in _ALIASING) and u.args and u.args[0] is n:
                seen.add(u)
                frontier.append(u)
    return None
