"""The all-to-alls of a Dynamo graph, however the model wrote them.

Spellings seen on torch 2.11-2.13: functional `funcol.all_to_all_single[_autograd]` (-> `_c10d_functional
[_autograd].all_to_all_single` + `wait_tensor`, sometimes waited twice, as torchtitan does); in-place
`dist.all_to_all_single(out, in)` (Dynamo remaps it to functional + `out.copy_(wait)`); torch <= 2.12's
`_FromTorchTensor` autograd.Function around the wait; and any of these inside an `autograd.Function`
(Megatron's `_AllToAll`), which Dynamo makes an `autograd_function_apply` HOP.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx

from moepass.analysis.graph import _ops, example_value, node_arg


def _all_to_all_targets() -> set:
    import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional_autograd)

    return _ops("_c10d_functional", "all_to_all_single") | _ops("_c10d_functional_autograd", "all_to_all_single")


_A2A = _all_to_all_targets()
_WAIT = _ops("_c10d_functional", "wait_tensor")
_AUTOGRAD_FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)


def is_all_to_all(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _A2A


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _A2A or node.target in _WAIT)


def is_autograd_function(node: fx.Node) -> bool:
    """An autograd.Function application Dynamo traced (side-effect free: Dynamo graph-breaks otherwise)."""
    return node.op == "call_function" and _AUTOGRAD_FUNCTION_APPLY is not None \
        and node.target is _AUTOGRAD_FUNCTION_APPLY


@dataclasses.dataclass
class AllToAll:
    """One all_to_all_single, however it was written."""

    node: fx.Node  # the collective call, or the autograd.Function application that wraps it
    input: fx.Node  # the rows sent
    output_splits: tuple | None  # entries are fx.Node (host sizes) or int; None: equal splits
    input_splits: tuple | None
    group_name: str
    result: fx.Node  # the rows received: wait_tensor, the buffer they were copied into, or the apply's output
    form: str  # "functional", "in-place" or "autograd.Function"


def _splits(value) -> tuple | None:
    return None if value is None else tuple(value)


def _received(gm: fx.GraphModule, a2a: fx.Node) -> tuple[fx.Node, str]:
    """(node holding the received rows, form) for one collective call."""
    wait = a2a
    while (after := _wait_after(gm, wait)) is not None:  # torchtitan waits again on already-waited counts
        wait = after
    copies = [u for u in wait.users if u.op == "call_method" and u.target == "copy_" and u.args[1] is wait]
    if wait is not a2a and len(copies) == 1 and len(wait.users) == 1 and _not_read_before(copies[0]):
        return copies[0].args[0], "in-place"  # dist.all_to_all_single(out, in), as Dynamo remaps it
    return wait, "functional"


def _not_read_before(copy: fx.Node) -> bool:
    """No one reads the buffer between its creation and this copy into it (so it stands for the copy)."""
    buffer, n = copy.args[0], copy.prev
    while n is not buffer and n.op != "root":
        if buffer in n.all_input_nodes:
            return False
        n = n.prev
    return n is buffer


def _wait_after(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The node's only user when that user waits on it: wait_tensor, or an autograd.Function whose
    forward only waits (torch <= 2.12 wraps all_to_all_single_autograd's output in `_FromTorchTensor`)."""
    if len(node.users) != 1:
        return None
    (user,) = node.users
    if user.op == "call_function" and user.target in _WAIT:
        return user
    if is_autograd_function(user):
        body = getattr(gm, user.args[0].target, None) if isinstance(user.args[0], fx.Node) else None
        # Dynamo lifts the SymInt split sizes into the call as well; only tensor operands count here
        tensors = [a for a in user.args[2:] if isinstance(a, fx.Node) and isinstance(example_value(a), torch.Tensor)]
        first = [u for u in user.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
        if isinstance(body, fx.GraphModule) and tensors == [node] and len(first) == 1 and _only_waits(body):
            return first[0]
    return None


def _only_waits(body: fx.GraphModule) -> bool:
    """The graph returns its one tensor input, possibly through wait_tensor calls."""
    calls = [n for n in body.graph.nodes if n.op not in ("placeholder", "output")]
    grad_mode = [n for n in calls if n.op == "call_function" and n.target is torch._C._set_grad_enabled]
    return all(n.op == "call_function" and n.target in _WAIT for n in calls if n not in grad_mode)


def _strip_contiguous(node):
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target == "contiguous":
        node = node.args[0]
    return node


def _inner_all_to_all(gm: fx.GraphModule, apply: fx.Node) -> AllToAll | None:
    """The all-to-all an autograd.Function's forward is made of, in terms of the outer graph's nodes."""
    body = getattr(gm, apply.args[0].target, None) if isinstance(apply.args[0], fx.Node) else None
    if not isinstance(body, fx.GraphModule):
        return None
    inner = [n for n in body.graph.nodes if is_all_to_all(n)]
    if len(inner) != 1:
        return None
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    outer_args = apply.args[2:]
    if len(placeholders) != len(outer_args):
        return None
    outer = dict(zip(placeholders, outer_args))
    (a2a,) = inner
    received, form = _received(body, a2a)
    output = next(n for n in body.graph.nodes if n.op == "output")
    returned = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    returned = returned[0] if isinstance(returned, (tuple, list)) else returned
    sent = _strip_contiguous(a2a.args[0])
    if returned is not received or sent not in outer:
        return None

    def lift(splits):
        if splits is None:
            return None
        if not all(isinstance(s, int) or s in outer for s in splits):
            raise LookupError
        return tuple(s if isinstance(s, int) else outer[s] for s in splits)

    try:
        out_splits = lift(node_arg(a2a, 1, "output_split_sizes"))
        in_splits = lift(node_arg(a2a, 2, "input_split_sizes"))
    except LookupError:
        return None
    first = [u for u in apply.users if u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0]
    if len(first) != 1:
        return None
    return AllToAll(apply, outer[sent], out_splits, in_splits, node_arg(a2a, 3, "group_name"), first[0],
                    f"autograd.Function ({form})")


def find_all_to_alls(gm: fx.GraphModule) -> list[AllToAll]:
    """Every all_to_all_single in the graph, and those inside autograd.Function applications."""
    found = []
    for n in gm.graph.nodes:
        if is_all_to_all(n):
            received, form = _received(gm, n)
            found.append(AllToAll(n, n.args[0], _splits(node_arg(n, 1, "output_split_sizes")),
                                  _splits(node_arg(n, 2, "input_split_sizes")), node_arg(n, 3, "group_name"),
                                  received, form))
        elif is_autograd_function(n):
            inner = _inner_all_to_all(gm, n)
            if inner is not None:
                found.append(inner)
    return found
