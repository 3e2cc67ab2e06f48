"""Expert-parallel regions in a Dynamo graph: find them, and check they do what DeepEP does.

An EP MoE block, as torchtitan, Megatron-style code and moepass.models write it, is

    counts all-to-all   tokens_per_expert[E] -> received_counts[E]            (splits to the host)
    token all-to-all    x[token_of_slot] (rows sorted by expert) -> received rows  (splits from the counts)
    expert-major gather received[perm] -> experts(rows, counts per local expert) -> y
    combine all-to-all  y put back in receive order -> rows in the order they were sent (splits swapped)
    weighted scatter    sum over each token's K rows (times its routing weight) -> [T, D]

The all-to-alls are anchors (functional `all_to_all_single[_autograd]`, in-place
`dist.all_to_all_single` (Dynamo turns it into functional + `copy_`), or either one inside an
autograd.Function). Everything between them is index arithmetic whose spelling differs between
implementations, so instead of matching every spelling the finder *evaluates* those index subgraphs
on a few concrete routings and checks the results against what the DeepEP rewrite assumes:
rows sent = x[token] (or x[token] * weight), counts = histogram of the expert ids, perm groups
received rows by local expert, counts fed to the experts are the per-expert totals, and the result
is sum_k weight * row (or sum_k row). A region where any check fails is left alone with the reason.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from collections import deque
from collections.abc import Callable, Iterable

import torch
from torch import fx
from torch.fx.node import map_arg

from moepass.graph import example_value, module_path, node_arg, tensor_meta


def _ops(namespace: str, name: str) -> set:
    ns = getattr(torch.ops, namespace, None)
    packet = getattr(ns, name, None) if ns is not None else None
    return {packet, packet.default} if packet is not None else set()


def _all_to_all_targets() -> set:
    import torch.distributed._functional_collectives  # noqa: F401  (registers _c10d_functional_autograd)

    return _ops("_c10d_functional", "all_to_all_single") | _ops("_c10d_functional_autograd", "all_to_all_single")


_A2A = _all_to_all_targets()
_WAIT = _ops("_c10d_functional", "wait_tensor")
_AUTOGRAD_FUNCTION_APPLY = getattr(torch.ops.higher_order, "autograd_function_apply", None)
_GUARDS = (_ops("aten", "_assert_scalar") | _ops("aten", "sym_constrain_range_for_size")
           | _ops("aten", "sym_constrain_range") | _ops("aten", "_assert_async")
           | {torch._check, torch._check_is_size})
_INDEX_DTYPES = (torch.int64, torch.int32)


# ---------------------------------------------------------------- node kinds


def is_all_to_all(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _A2A


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in _A2A or node.target in _WAIT)


def is_autograd_function(node: fx.Node) -> bool:
    """An autograd.Function application Dynamo traced (side-effect free: Dynamo graph-breaks otherwise)."""
    return node.op == "call_function" and _AUTOGRAD_FUNCTION_APPLY is not None \
        and node.target is _AUTOGRAD_FUNCTION_APPLY


def is_guard(node: fx.Node) -> bool:
    """A runtime check (`_assert_scalar`, `_assert_tensor_metadata`, ...): needed only while what it checks is."""
    if node.op != "call_function":
        return False
    t = node.target
    return t in _GUARDS or (isinstance(t, torch._ops.OpOverload) and "assert" in t._opname)


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
    return None


def _is_scalar_valued(node: fx.Node) -> bool:
    return not isinstance(example_value(node), torch.Tensor)


def _index_meta(node) -> torch.Tensor | None:
    t = tensor_meta(node)
    return t if t is not None and t.dtype in _INDEX_DTYPES else None


def _static_shape(t: torch.Tensor) -> tuple[int, ...] | None:
    return tuple(t.shape) if all(isinstance(s, int) for s in t.shape) else None


def _has_shape(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    """Static shape equality; a symbolic size never equals (comparing it would add a guard)."""
    return t is not None and _static_shape(t) == shape


# ---------------------------------------------------------------- the all-to-alls


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
    sent = a2a.args[0]
    while isinstance(sent, fx.Node) and sent.op == "call_method" and sent.target == "contiguous":
        sent = sent.args[0]
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
    """Every all_to_all_single in the graph's top level and inside autograd.Function applications."""
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


# ---------------------------------------------------------------- walking and evaluating subgraphs


def data_inputs(node: fx.Node) -> list[fx.Node]:
    """What a node's value depends on: its inputs, and for a buffer the in-place writes into it."""
    return list(node.all_input_nodes) + [u for u in node.users if written_buffer(u) is node]


def data_users(node: fx.Node) -> list[fx.Node]:
    """Nodes whose value depends on this one; a write makes the buffer written into depend on it too."""
    users = list(node.users)
    buffer = written_buffer(node)
    return users + ([buffer] if buffer is not None else [])


def ancestors(node: fx.Node, stop: Iterable[fx.Node] = ()) -> set[fx.Node]:
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


_positions: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def positions(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's index in graph order (cached while the graph keeps its node count; the finder never edits)."""
    cached = _positions.get(graph)
    if cached is None or cached[0] != len(graph.nodes):
        cached = _positions[graph] = (len(graph.nodes), {n: i for i, n in enumerate(graph.nodes)})
    return cached[1]


def forget_positions(graph: fx.Graph) -> None:
    """Call after editing a graph the finder has seen."""
    _positions.pop(graph, None)


class NotEvaluable(Exception):
    """A subgraph that cannot be computed from the given leaves alone."""


def backward_slice(outputs: list[fx.Node], leaves: Iterable[fx.Node],
                   forbidden: Iterable[fx.Node] = ()) -> list[fx.Node]:
    """Nodes (in graph order) that compute `outputs` from `leaves`, with the in-place writes they see."""
    leaves, forbidden = set(leaves), set(forbidden)
    order = positions(outputs[0].graph)
    last = max(order[o] for o in outputs)
    needed, frontier = set(), list(outputs)
    while frontier:
        n = frontier.pop()
        if n in needed or n in leaves:
            continue
        if n in forbidden:
            raise NotEvaluable(f"depends on {n.name}")
        if n.op in ("placeholder", "call_module") or is_collective(n) or is_autograd_function(n):
            raise NotEvaluable(f"depends on {n.name} ({n.op} {n.target})")
        needed.add(n)
        frontier.extend(n.all_input_nodes)
        frontier.extend(u for u in n.users if written_buffer(u) is n and order[u] < last)
    return sorted(needed, key=order.__getitem__)


def evaluate(gm: fx.GraphModule, outputs: list[fx.Node], leaf_values: dict, forbidden: Iterable[fx.Node] = ()) -> list:
    """Run the slice of the graph that computes `outputs` from concrete leaf values."""
    env = dict(leaf_values)
    with torch.no_grad():
        for n in backward_slice(outputs, leaf_values, forbidden):
            args, kwargs = map_arg((n.args, n.kwargs), env.__getitem__)
            try:
                if n.op == "get_attr":
                    value = operator.attrgetter(n.target)(gm)
                elif n.op == "call_method":
                    value = getattr(args[0], n.target)(*args[1:], **kwargs)
                else:
                    value = n.target(*args, **kwargs)
            except Exception as error:  # e.g. an index out of range: the sample does not fit the code's assumptions
                raise NotEvaluable(f"{n.name} raised {type(error).__name__}: {error}") from error
            env[n] = value
    return [env[o] for o in outputs]


# ---------------------------------------------------------------- the region


@dataclasses.dataclass
class EPRegion:
    """One dispatch + combine region, with what the DeepEP rewrite needs."""

    module: str
    counts_a2a: AllToAll
    token_a2a: AllToAll
    combine_a2a: AllToAll
    x: fx.Node  # token rows [T, D] before routing
    topk_ids: fx.Node  # [T, K] global expert ids
    topk_weights: fx.Node  # [T, K] routing weights
    num_experts: int
    group_size: int
    group_name: str
    expert_input: fx.Node  # received rows gathered expert-major, the experts' input
    expert_counts: fx.Node  # rows per local expert fed to the experts
    expert_output: fx.Node  # the experts' output rows, in expert_input's order
    tokens_out: fx.Node  # [T, D]: sum over each token's K expert rows (weighted or not)
    weights_applied: str  # "before_experts" or "after_experts"
    checked_routings: int = 0

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.group_size


@dataclasses.dataclass
class RegionSkip:
    node: fx.Node
    module: str
    reason: str


class _Mismatch(Exception):
    def __init__(self, node: fx.Node, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


def find_ep_regions(gm: fx.GraphModule) -> tuple[list[EPRegion], list[RegionSkip]]:
    """Every EP dispatch/combine region, checked; and every all-to-all left alone, with the reason. Pure."""
    a2as = find_all_to_alls(gm)
    order = positions(gm.graph)
    # backward walks stop at all-to-alls: what a region computes lies between its own ones
    boundary = {a.node for a in a2as} | {a.result for a in a2as}
    regions, skips, used = [], [], set()
    for tok in a2as:
        comb = next((c for c in a2as if c is not tok and _is_reverse(tok, c) and order[c.node] > order[tok.node]), None)
        if comb is None:
            continue
        # the nearest one: an earlier layer's counts feed these splits too, through the hidden states
        counts = next((c for c in reversed(a2as) if c not in (tok, comb) and order[c.node] < order[tok.node]
                       and _feeds_splits(c, tok, boundary)), None)
        used.update({id(tok), id(comb)} | ({id(counts)} if counts else set()))
        try:
            if counts is None:
                raise _Mismatch(tok.node, "no counts all-to-all found upstream of the token all-to-all's split sizes")
            regions.append(_match_region(gm, counts, tok, comb, order, boundary))
        except _Mismatch as m:
            skips.append(RegionSkip(m.node, module_path(tok.node), m.reason))
        except Exception as error:  # an unforeseen graph shape must not break the user's compile
            skips.append(RegionSkip(tok.node, module_path(tok.node),
                                    f"could not analyse the region ({type(error).__name__}: {error})"))
    for a in a2as:
        if id(a) not in used:
            skips.append(RegionSkip(a.node, module_path(a.node), "all-to-all is not part of a dispatch/combine pair "
                                                                 "(no later all-to-all with swapped splits)"))
    return regions, skips


def _same_split(a, b) -> bool:
    return a is b or (isinstance(a, int) and isinstance(b, int) and a == b)


def _is_reverse(tok: AllToAll, comb: AllToAll) -> bool:
    """comb sends back what tok received: rows, same group, host split sizes swapped."""
    if tok.group_name != comb.group_name or tok.output_splits is None or tok.input_splits is None:
        return False
    if not all(_has_rows(a.input) for a in (tok, comb)) or \
            not any(isinstance(s, fx.Node) for s in tok.output_splits + tok.input_splits):
        return False
    if comb.input_splits is None or comb.output_splits is None or len(tok.input_splits) != len(comb.output_splits):
        return False
    return all(_same_split(a, b) for a, b in zip(tok.output_splits, comb.input_splits)) and \
        all(_same_split(a, b) for a, b in zip(tok.input_splits, comb.output_splits))


def _has_rows(node) -> bool:
    t = tensor_meta(node)
    return t is not None and t.dim() == 2


def _feeds_splits(counts: AllToAll, tok: AllToAll, boundary: set[fx.Node]) -> bool:
    split_nodes = [s for s in tok.output_splits or () if isinstance(s, fx.Node)]
    return counts.group_name == tok.group_name and any(counts.result in ancestors(s, boundary) for s in split_nodes)


# ---------------------------------------------------------------- checking one region

_NUM_ROUTINGS = 3
_MAX_RESULT_CANDIDATES = 8  # [T, D] values after the combine tried as the region's result, in graph order


def _routings(num_tokens: int, top_k: int, num_experts: int, seed: int = 0):
    """Top-k expert ids (distinct per token): random, all on the first experts, all on the last experts."""
    gen = torch.Generator().manual_seed(seed)
    random_ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    first = torch.arange(top_k).expand(num_tokens, top_k)
    last = (num_experts - 1 - torch.arange(top_k)).expand(num_tokens, top_k)
    return [random_ids, first.contiguous(), last.contiguous()][:_NUM_ROUTINGS]


def _received_counts(num_ranks: int, local: int, seed: int = 0):
    """Received counts [W*E_l] (rank-major): random with zeros, one expert only, nothing at all."""
    gen = torch.Generator().manual_seed(seed)
    random_counts = torch.randint(0, 4, (num_ranks * local,), generator=gen)
    one = torch.zeros(num_ranks * local, dtype=torch.int64)
    one[-1] = 5
    return [random_counts, one, torch.zeros_like(one)]


def _match_region(gm, counts: AllToAll, tok: AllToAll, comb: AllToAll, order, boundary) -> EPRegion:
    """Identify the pieces of one region and check them by evaluation; raise _Mismatch with a reason."""
    num_ranks = len(tok.input_splits)
    counts_meta = _index_meta(counts.input)
    if counts_meta is None or counts_meta.dim() != 1 or not isinstance(counts_meta.shape[0], int):
        raise _Mismatch(counts.node, "counts all-to-all does not send a 1-D integer count per expert")
    num_experts = counts_meta.shape[0]
    if num_experts % num_ranks or counts.input_splits not in (None, (num_experts // num_ranks,) * num_ranks):
        raise _Mismatch(counts.node, f"{num_experts} expert counts are not split evenly over {num_ranks} ranks")
    local = num_experts // num_ranks

    ids = nearest_ancestors(counts.input, lambda n: (t := _index_meta(n)) is not None and t.dim() == 2)
    if len(ids) != 1:
        raise _Mismatch(counts.node, "could not find the top-k expert ids [T, K] the counts are made from")
    ids = ids[0]
    num_tokens, top_k = _static_shape(tensor_meta(ids)) or (None, None)
    sent = tensor_meta(tok.input)
    if num_tokens is None or sent is None or sent.dim() != 2 or not isinstance(sent.shape[1], int):
        raise _Mismatch(tok.node, "expert ids or sent rows have dynamic shapes; only static token counts are checked")
    hidden = sent.shape[1]
    if hidden < 5:
        raise _Mismatch(tok.node, f"hidden size {hidden} < 5: too narrow to check which token each row carries")

    def is_x(n):
        t = tensor_meta(n)
        return _has_shape(t, (num_tokens, hidden)) and t.is_floating_point() \
            and ids not in ancestors(n, boundary | {ids})

    x = nearest_ancestors(tok.input, is_x, stop=[ids])
    if len(x) != 1:
        raise _Mismatch(tok.node, f"could not find the token rows x [{num_tokens}, {hidden}] "
                                  "the sent rows are gathered from")
    x = x[0]

    def is_weights(n):
        t = tensor_meta(n)
        return _has_shape(t, (num_tokens, top_k)) and t.is_floating_point()

    weights_pre = set(nearest_ancestors(tok.input, is_weights, stop=[ids, x]))
    tokens_out, weights = _find_tokens_out(comb, ids, x, weights_pre, is_weights, (num_tokens, hidden))
    if any(order[n] > order[tok.node] for n in (x, ids, weights)):
        raise _Mismatch(tok.node, "x, expert ids or routing weights are computed after the token all-to-all")

    gather, perm = _expert_major_gather(tok)
    expert_output = _unpermuted_rows(comb, perm)
    if gather not in ancestors(expert_output, stop={gather, tok.result, counts.result}):
        raise _Mismatch(comb.node, "the rows sent back are not computed from the expert-major received rows")
    expert_counts = _expert_counts(gm, counts, tok, gather, expert_output, local)
    _check_no_escape(tok, tokens_out, stop={x, ids, weights, counts.node})

    region = EPRegion(module_path(tokens_out), counts, tok, comb, x, ids, weights, num_experts, num_ranks,
                      tok.group_name, gather, expert_counts, expert_output, tokens_out, "")
    region.weights_applied, slots = _check_send_side(gm, region, hidden)
    _check_receive_side(gm, region, perm)
    _check_tokens_out(gm, region, slots)
    region.checked_routings = _NUM_ROUTINGS
    return region


def _find_tokens_out(comb, ids, x, weights_pre, is_weights, shape):
    """The first [T, D] value after the combine computable from (returned rows, ids, weights) alone."""
    def is_token_rows(n):
        return _has_shape(t := tensor_meta(n), shape) and t.is_floating_point()

    for n in later_values(comb.result, comb.node, is_token_rows, _MAX_RESULT_CANDIDATES):
        weights = weights_pre | set(nearest_ancestors(n, is_weights, stop=[ids, x, comb.result]))
        if len(weights) != 1:
            continue
        try:
            backward_slice([n], {comb.result, ids, x, *weights})
        except NotEvaluable:
            continue
        return n, next(iter(weights))
    raise _Mismatch(comb.node, "no [T, D] result computed from the returned rows, expert ids "
                               "and one routing-weight tensor")


def _strip_contiguous(node):
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target == "contiguous":
        node = node.args[0]
    return node


def _row_index(index) -> fx.Node | None:
    """`perm` of `rows[perm]` or `rows[perm, :]`."""
    if isinstance(index, fx.Node):
        return index
    if isinstance(index, tuple) and len(index) == 2 and isinstance(index[0], fx.Node) and index[1] == slice(None):
        return index[0]
    return None


def _expert_major_gather(tok: AllToAll) -> tuple[fx.Node, fx.Node]:
    """(received[perm], perm): the one data use of the received rows."""
    readers = [u for u in tok.result.users if not (u.op == "call_method" and u.target in ("size", "dim"))
               and not (u.op == "call_function" and u.target in (getattr, torch.ops.aten.sym_size.int))
               and written_buffer(u) is not tok.result]
    if len(readers) == 1:
        g = readers[0]
        if g.op == "call_function" and g.target is operator.getitem and g.args[0] is tok.result:
            perm = _row_index(g.args[1])
            if perm is not None:
                return g, perm
        if g.op in ("call_function", "call_method") and getattr(g.target, "__name__", g.target) == "index_select" \
                and g.args[0] is tok.result and node_arg(g, 1, "dim") == 0:
            return g, node_arg(g, 2, "index")
    names = ", ".join(u.name for u in readers)
    raise _Mismatch(tok.node, f"received rows are read by [{names}], not by one expert-major gather received[perm]")


def _unpermuted_rows(comb: AllToAll, perm: fx.Node) -> fx.Node:
    """The experts' output y that the combine sends back after undoing perm."""
    sent = _strip_contiguous(comb.input)
    if sent.op == "call_method" and sent.target == "index_copy" or \
            sent.op == "call_function" and sent.target in (torch.index_copy, torch.Tensor.index_copy):
        if node_arg(sent, 1, "dim") == 0 and node_arg(sent, 2, "index") is perm:
            return node_arg(sent, 3, "source")
    writes = [u for u in sent.users if written_buffer(u) is sent]
    if len(writes) == 1 and writes[0].op == "call_function" and writes[0].target is operator.setitem \
            and _row_index(writes[0].args[1]) is perm and isinstance(writes[0].args[2], fx.Node):
        return writes[0].args[2]
    raise _Mismatch(comb.node, "rows sent back are not the experts' output un-permuted with the same perm "
                               "(index_copy(0, perm, y) or buf[perm] = y)")


def _expert_counts(gm, counts: AllToAll, tok: AllToAll, gather, expert_output, local) -> fx.Node:
    """The one node through which the received counts reach the experts: rows per local expert."""
    received = {tok.result, counts.result}
    expert_nodes = between({gather}, expert_output, stop=received)
    side = {a for n in expert_nodes - {gather} for a in n.all_input_nodes if a not in expert_nodes}
    upstream = {s: ancestors(s, stop=received) | {s} for s in side}
    if any(tok.result in up for up in upstream.values()):
        raise _Mismatch(tok.node, "the experts read the received rows other than through the expert-major gather")
    from_counts = [s for s in side if counts.result in upstream[s]]
    if not from_counts:
        raise _Mismatch(tok.node, "the experts are given no group sizes derived from the received counts")
    candidates = {c for s in from_counts for c in upstream[s]
                  if _has_shape(_index_meta(c), (local,)) and counts.result in ancestors(c, stop=received)}
    order = positions(gm.graph)
    num_ranks = len(tok.input_splits)
    for c in sorted(candidates, key=order.__getitem__, reverse=True):
        try:
            for s in from_counts:
                backward_slice([s], {c}, forbidden={counts.result, tok.result})
            if all(_counts_per_local_expert(gm, counts, c, received, num_ranks)
                   for received in _received_counts(num_ranks, local)):
                return c
        except NotEvaluable:
            continue
    raise _Mismatch(tok.node, "the experts' group sizes are not the received rows per local expert "
                              "(padded, or not only derived from the received counts)")


def _counts_per_local_expert(gm, counts: AllToAll, node: fx.Node, received: torch.Tensor, num_ranks: int) -> bool:
    (value,) = evaluate(gm, [node], {counts.result: _value(counts.result, received)})
    return torch.equal(_host(value).long(), received.view(num_ranks, -1).sum(0))


def _check_no_escape(tok: AllToAll, tokens_out: fx.Node, stop: set[fx.Node]) -> None:
    """Every value between the token all-to-all and the result is used only inside the region."""
    inner = between({tok.node}, tokens_out, stop) - {tokens_out}
    for n in inner:
        for u in n.users:
            only_guarded = _is_scalar_valued(u) and not u.users.keys() - _guards_of(u)
            if u in inner or u is tokens_out or is_guard(u) or only_guarded:
                continue
            raise _Mismatch(tok.node, f"{n.name} (inside the EP region) is also used by {u.name}, outside it")


def _guards_of(node: fx.Node) -> set[fx.Node]:
    return {u for u in node.users if is_guard(u)}


# ---------------------------------------------------------------- evaluation checks


def _weights_sample(shape, seed):
    # powers of two other than 1: every product and sum below is exact, even in bf16
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([0.5, 2.0])[torch.randint(0, 2, shape, generator=gen)]


def _x_sample(num_tokens, hidden, seed):
    """Token t's row: 1, then t in base-16 digits, then small integers."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (num_tokens, hidden), generator=gen).double()
    t = torch.arange(num_tokens)
    x[:, 0] = 1
    for digit in range(4):
        x[:, 1 + digit] = (t // 16**digit) % 16
    return x


def _value(node, v):
    t = tensor_meta(node)
    return v.to(dtype=t.dtype, device=t.device)


def _host(v):
    return torch.as_tensor(v).detach().cpu()


def _check_send_side(gm, region: EPRegion, hidden: int) -> tuple[str, list[torch.Tensor]]:
    """Counts, split sizes and rows sent match the routing.

    Returns where the weights are applied and, per routing, the (token * K + k) slot each sent row carries.
    """
    tok, counts = region.token_a2a, region.counts_a2a
    num_tokens, top_k = tensor_meta(region.topk_ids).shape
    weights_applied, slots = None, []
    for i, ids in enumerate(_routings(num_tokens, top_k, region.num_experts)):
        w, x = _weights_sample((num_tokens, top_k), i), _x_sample(num_tokens, hidden, i)
        leaves = {region.topk_ids: _value(region.topk_ids, ids), region.topk_weights: _value(region.topk_weights, w),
                  region.x: _value(region.x, x)}
        split_nodes = [s for s in tok.input_splits if isinstance(s, fx.Node)]
        try:
            sent_counts, sent, *splits = evaluate(gm, [counts.input, tok.input, *split_nodes], leaves)
        except NotEvaluable as e:
            raise _Mismatch(tok.node, f"rows or counts sent are not computed from x, expert ids and weights alone: {e}")
        expected_counts = torch.bincount(ids.reshape(-1), minlength=region.num_experts)
        if not torch.equal(_host(sent_counts).long(), expected_counts):
            raise _Mismatch(counts.node, "counts sent are not the number of top-k slots per expert")
        splits = iter(splits)
        sizes = [s if isinstance(s, int) else int(next(splits)) for s in tok.input_splits]
        if sizes != expected_counts.view(region.group_size, -1).sum(1).tolist():
            raise _Mismatch(tok.node, "input split sizes are not the per-rank sums of the expert counts")
        here, slot = _sent_slots(_host(sent).double(), ids, w, x, expected_counts, top_k)
        if here is None or weights_applied not in (None, here):
            raise _Mismatch(tok.node, "rows sent are not x[token] (or x[token] * its routing weight) "
                                      "for every (token, expert) slot, sorted by expert")
        weights_applied = here
        slots.append(slot)
    return weights_applied, slots


def _sent_slots(sent, ids, w, x, expert_counts, top_k) -> tuple[str | None, torch.Tensor | None]:
    """('before_experts' | 'after_experts', slot of each row) when the rows sent are the slots sorted
    by expert, else (None, None)."""
    num_tokens, wrong = ids.shape[0], (None, None)
    if sent.shape != (num_tokens * top_k, x.shape[1]):
        return wrong
    scale = sent[:, 0]
    if torch.any(scale == 0):
        return wrong
    digits = sent[:, 1:5] / scale.unsqueeze(1)
    token = (digits * torch.tensor([1.0, 16, 256, 4096], dtype=torch.float64)).sum(1).round().long()
    if token.min() < 0 or token.max() >= num_tokens:
        return wrong
    expert = torch.repeat_interleave(torch.arange(len(expert_counts)), expert_counts)
    match = ids[token] == expert.unsqueeze(1)
    if not torch.all(match.sum(1) == 1):
        return wrong
    slot = token * top_k + match.long().argmax(1)
    if not torch.equal(torch.sort(slot).values, torch.arange(num_tokens * top_k)):
        return wrong
    if not torch.equal(sent, x[token] * scale.unsqueeze(1)):
        return wrong
    if torch.all(scale == 1):
        return "after_experts", slot
    if torch.equal(scale, w.double().reshape(-1)[slot]):
        return "before_experts", slot
    return wrong


def _check_receive_side(gm, region: EPRegion, perm: fx.Node) -> None:
    """perm groups received rows by local expert; the experts' counts are the per-expert totals."""
    tok, counts = region.token_a2a, region.counts_a2a
    local, hidden = region.num_local_experts, tensor_meta(tok.input).shape[1]
    out_split_nodes = [s for s in tok.output_splits if isinstance(s, fx.Node)]
    for received in _received_counts(region.group_size, local):
        rows = torch.zeros(int(received.sum()), hidden)
        leaves = {counts.result: _value(counts.result, received), tok.result: _value(tok.result, rows)}
        try:
            got_perm, *splits = evaluate(gm, [perm, *out_split_nodes], leaves,
                                                     forbidden={region.counts_a2a.node})
        except NotEvaluable as e:
            raise _Mismatch(tok.node, f"expert-major permutation is not computed from the received counts alone: {e}")
        per_rank = received.view(region.group_size, local)
        splits = iter(splits)
        sizes = [s if isinstance(s, int) else int(next(splits)) for s in tok.output_splits]
        if sizes != per_rank.sum(1).tolist():
            raise _Mismatch(tok.node, "output split sizes are not the per-rank sums of the received counts")
        got_perm = _host(got_perm).long()
        expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(region.group_size), received)
        if got_perm.shape != (len(rows),) or not torch.equal(torch.sort(got_perm).values, torch.arange(len(rows))):
            raise _Mismatch(tok.node, "the expert-major gather index is not a permutation of the received rows")
        if not torch.all(expert_of_row[got_perm].diff() >= 0):
            raise _Mismatch(tok.node, "the expert-major gather does not group received rows by local expert")


def _check_tokens_out(gm, region: EPRegion, slots: list[torch.Tensor]) -> None:
    """The result is sum_k weight * returned row (weights after experts) or sum_k returned row."""
    comb = region.combine_a2a
    num_tokens, top_k = tensor_meta(region.topk_ids).shape
    hidden = tensor_meta(comb.input).shape[1]
    for i, ids in enumerate(_routings(num_tokens, top_k, region.num_experts)):
        w, x = _weights_sample((num_tokens, top_k), i), _x_sample(num_tokens, hidden, i)
        gen = torch.Generator().manual_seed(100 + i)
        returned = torch.randint(-2, 3, (num_tokens * top_k, hidden), generator=gen).double()
        leaves = {region.topk_ids: _value(region.topk_ids, ids), region.topk_weights: _value(region.topk_weights, w),
                  region.x: _value(region.x, x), comb.result: _value(comb.result, returned)}
        try:
            (out,) = evaluate(gm, [region.tokens_out], leaves)
        except NotEvaluable as e:
            raise _Mismatch(comb.node, f"result is not computed from the returned rows, ids and weights alone: {e}")
        # row j came back for the slot sent in row j (the experts' rows are un-permuted before the combine)
        row_of_slot = torch.empty_like(slots[i])
        row_of_slot[slots[i]] = torch.arange(len(slots[i]))
        rows = returned[row_of_slot].view(num_tokens, top_k, hidden)
        scale = w.double().unsqueeze(-1) if region.weights_applied == "after_experts" else 1.0
        if not torch.equal(_host(out).double(), (rows * scale).sum(1)):
            where = "after the experts" if region.weights_applied == "after_experts" else "before the experts"
            raise _Mismatch(comb.node, f"result is not the sum of each token's K returned rows "
                                       f"(routing weights applied {where})")
