"""Expert-parallel regions in a Dynamo graph, found by what they compute.

An EP MoE block, however it is spelled, is

    counts all-to-all   per-expert slot counts [E] (or [ranks, E/ranks]) -> received counts   (splits to the host)
    token all-to-all    x[token of slot] (rows sorted by expert) -> received rows        (splits from the counts)
    expert-major gather received[perm] -> experts(rows, rows per local expert) -> y
    combine all-to-all  y un-permuted -> rows in the order they were sent               (splits swapped)
    weighted sum        sum over each token's K rows (times its routing weight) -> [T, D] (or [B, S, D])

The all-to-alls are the anchors (moepass.analysis.collectives). The finder names the region's leaves
and joints by data-flow position and shape only (expert ids: the integer tensor both the counts and the
sent rows come from; x: the [T, D] rows the sent rows are gathered from; the result: the first [T, D]
value after the combine computable from the returned rows, ids and one [T, K] weight tensor), then
moepass.analysis.ep_checks *evaluates* the index subgraphs on concrete routings and proves each joint
computes what DeepEP's dispatch/combine compute. How the counts were built (bincount, histc, one_hot,
scatter_), how splits reach the host (.tolist(), .item(), .cpu()) and how rows are scattered back
(index_add, scatter_add, index_put, a reshape and sum, a custom scatter-add op) is never matched.
"""

from __future__ import annotations

import math

import sympy
from torch import fx

from moepass.analysis.graph import ancestors, between, data_inputs, data_users, example_value, graph_order, is_guard, is_unused, later_values, nearest_ancestors, static_int, static_shape, tensor_meta, written_buffer
from moepass.analysis.node_module import module_path
from moepass.skips import SkipCode

from .collectives import AllToAll, find_all_to_alls
from .counts_length import bincount_lengths, pin
from .ep_checks import check_region
from .ep_parts import EPRegion, Mismatch, RegionSkip, index_meta
from .evaluate import NotEvaluable, backward_slice
from .symbols import concrete, example_sizes, numel_expr, same, sample_bindings, shape_exprs, size_expr

_MAX_RESULT_CANDIDATES = 8  # [T, D] values after the combine tried as the region's result, in graph order


def find_ep_regions(gm: fx.GraphModule) -> tuple[list[EPRegion], list[RegionSkip]]:
    """Every EP dispatch/combine region of one graph, checked; and every all-to-all left alone, with the reason.

    Reads the graph and evaluates slices of it on samples, never edits it. The one thing it tells the shape
    environment is a bincount length it proved (moepass.analysis.counts_length), as a torch._check would.
    """
    a2as = find_all_to_alls(gm)
    order = graph_order(gm.graph)
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
                earlier = any(order[c.node] < order[tok.node] for c in a2as if c is not tok)
                raise Mismatch(tok.node, SkipCode.NO_COUNTS_EXCHANGE,
                               "no counts all-to-all found upstream of the token all-to-all's split sizes"
                               + ("" if earlier else f" ({_split_over_graphs('the counts exchange', 'before')})"))
            regions.append(_match_region(gm, counts, tok, comb, boundary, check_region))
        except Mismatch as m:
            skips.append(RegionSkip(m.node, module_path(tok.node), m.reason, m.code))
        except Exception as error:  # an unforeseen graph shape must not break the user's compile
            skips.append(RegionSkip(tok.node, module_path(tok.node),
                                    f"could not analyse the region ({type(error).__name__}: {error})",
                                    SkipCode.ANALYSIS_ERROR))
    for a in a2as:
        if id(a) not in used:
            skips.append(RegionSkip(a.node, module_path(a.node), "all-to-all is not part of a dispatch/combine pair "
                                    + _unpaired_why(a, a2as, order), SkipCode.NOT_A_PAIR))
    return regions, skips


def _split_over_graphs(what: str, where: str) -> str:
    """Why a region's other collective may be missing: a graph break splits the region, seen one part at a time."""
    return (f"there is none in this graph {where} it: if {what} is in another graph, a graph break splits the region "
            "(TORCH_LOGS=graph_breaks says where; async_op=True collectives with work.wait() and data-dependent "
            "branches break graphs, funcol.all_to_all_single does not)")


def _unpaired_why(a: AllToAll, a2as: list[AllToAll], order: dict) -> str:
    splits = (a.output_splits or ()) + (a.input_splits or ())
    rows = tensor_meta(a.input)
    if rows is not None and rows.dim() >= 2 and not any(isinstance(s, fx.Node) for s in splits):
        # None, [] or ints: sizes fixed at trace time (a counts exchange sends 1-D counts)
        return ("(its split sizes are fixed at trace time, not routed counts: no token exchange of an MoE, or a "
                "capacity-padded one, which sends padding where DeepEP sends only the routed (token, expert) slots)")
    if not any(order[c.node] > order[a.node] for c in a2as):
        return f"(no later all-to-all with swapped splits: {_split_over_graphs('the reverse all-to-all', 'after')})"
    return "(no later all-to-all with swapped splits)"


# ---------------------------------------------------------------- pairing the all-to-alls


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


# ---------------------------------------------------------------- naming the region's parts


def token_rows(node, rows, width, floating: bool = True) -> bool:
    """`node` holds `rows` token rows of `width` values: [rows, width], or [B, S, width] with B * S == rows
    (sizes as ints or expressions of the graph's size symbols)."""
    t, shape = tensor_meta(node), shape_exprs(node)
    return shape is not None and len(shape) >= 2 and t.is_floating_point() == floating \
        and same(shape[-1], size_expr(width) if isinstance(width, int) else width) \
        and same(numel_expr(shape[:-1]), size_expr(rows) if isinstance(rows, int) else rows)


_MAX_IDS_CANDIDATES = 3  # integer tensors tried as the top-k ids, nearest to the counts first


def _match_region(gm, counts: AllToAll, tok: AllToAll, comb: AllToAll, boundary: set[fx.Node], check) -> EPRegion:
    """Identify and check one region. The top-k ids are the integer [T, K] tensor both the counts and the sent
    rows come from; a routing map ([T, E] one-hot) also is, so candidates are tried nearest first and the
    first whose checks pass wins. Else the reason given is that of the candidate whose analysis got furthest,
    then the narrowest (ids have K <= E columns, a routing map E)."""
    num_experts, pinned = _check_counts_exchange(counts, tok, boundary)
    mismatches = []
    for ids in _ids_candidates(counts, tok, boundary):
        try:
            region = identify_region(gm, counts, tok, comb, boundary, ids, num_experts)
            region.pinned_lengths = pinned
            check(gm, region)
            return region
        except Mismatch as m:
            mismatches.append((-m.stage, tensor_meta(ids).shape[-1], len(mismatches), m))
    if not mismatches:
        raise Mismatch(counts.node, SkipCode.NO_TOPK_IDS,
                       "could not find the top-k expert ids [T, K] both the counts and the rows "
                       "sent are computed from")
    raise min(mismatches, key=lambda m: m[:3])[3]


def _check_counts_exchange(counts: AllToAll, tok: AllToAll, boundary: set[fx.Node]) -> tuple[int, list]:
    """The number of experts, when the counts exchange sends a static count per expert split evenly over ranks;
    and the bincount lengths that had to be proven (and pinned) to make it static."""
    num_ranks = len(tok.input_splits)
    counts_shape, pinned = static_shape(index_meta(counts.input)), []
    if not counts_shape and index_meta(counts.input) is not None:
        # bincount(ids, minlength=E) has a data-dependent length, E when the ids are provably < E
        sent, lengths = _describe(counts.input), bincount_lengths(counts.input, boundary)
        unproven = next((b for b in lengths if b.length is None), None)
        if unproven is not None:
            raise Mismatch(counts.node, SkipCode.BINCOUNT_LENGTH,
                           f"counts all-to-all does not send a static integer count per expert (sends "
                           f"{sent}, bincount `{unproven.bincount.name}`): bincount's length is data "
                           f"dependent and {unproven.why}")
        for length in lengths:
            pin(length)
        pinned, counts_shape = lengths, static_shape(index_meta(counts.input))
    if not counts_shape:
        raise Mismatch(counts.node, SkipCode.NOT_COUNT_PER_EXPERT,
                       "counts all-to-all does not send a static integer count per expert "
                       f"(sends {_describe(counts.input)})")
    num_experts, rows = math.prod(counts_shape), counts_shape[0]
    splits = None if counts.input_splits is None else tuple(
        static_int(example_value(s) if isinstance(s, fx.Node) else s) for s in counts.input_splits)
    if num_experts % num_ranks or rows % num_ranks or splits not in (None, (rows // num_ranks,) * num_ranks):
        raise Mismatch(counts.node, SkipCode.EXPERTS_UNEVEN,
                       f"{num_experts} expert counts ({list(counts_shape)}, splits "
                       f"{counts.input_splits}) are not split evenly over {num_ranks} ranks")
    return num_experts, pinned


def _ids_candidates(counts: AllToAll, tok: AllToAll, boundary: set[fx.Node]) -> list[fx.Node]:
    sent_upstream = ancestors(tok.input, boundary)

    def is_ids(n):
        t = index_meta(n)
        return n in sent_upstream and t is not None and t.dim() >= 2 and static_int(t.shape[-1]) is not None

    found, seen, frontier = [], {counts.input}, [counts.input]
    while frontier and len(found) < _MAX_IDS_CANDIDATES:  # breadth-first, expanding past accepted nodes too
        nxt = []
        for n in frontier:
            for a in data_inputs(n):
                if a not in seen and a not in boundary:
                    seen.add(a)
                    nxt.append(a)
                    if is_ids(a):
                        found.append(a)
        frontier = nxt
    return found[:_MAX_IDS_CANDIDATES]


def identify_region(gm, counts: AllToAll, tok: AllToAll, comb: AllToAll, boundary: set[fx.Node], ids: fx.Node,
                    num_experts: int) -> EPRegion:
    """Name the leaves and joints of one region from its top-k ids (structure only; ep_checks proves what
    they compute)."""
    order = graph_order(gm.graph)
    num_ranks = len(tok.input_splits)
    ids_shape = shape_exprs(ids)
    top_k, tokens = static_int(tensor_meta(ids).shape[-1]), numel_expr(ids_shape[:-1])
    hidden = size_expr(tensor_meta(tok.input).shape[1])

    def before_tokens_sent(n):
        return order[n] < order[tok.node]

    def is_weights(n):
        return token_rows(n, tokens, top_k) and before_tokens_sent(n)

    # weights applied to the sent rows come first: the router path behind them also reaches x. The search
    # stops at token rows (x and anything like it), behind which lie earlier layers' weights. An empty batch
    # (T=0) makes every empty tensor look like token rows: there weights must be shaped exactly like the ids
    if tokens == 0:
        token_like, like_ids = set(), {ids_shape, (sympy.Integer(0), ids_shape[-1])}
        weights_pre = set(nearest_ancestors(tok.input, lambda n: is_weights(n) and shape_exprs(n) in like_ids,
                                            stop=[ids]))
    else:
        token_like = {n for n in ancestors(tok.input, boundary) if token_rows(n, tokens, hidden)}
        weights_pre = set(nearest_ancestors(tok.input, is_weights, stop=[ids, *token_like]))

    def is_x(n):
        return token_rows(n, tokens, hidden) and before_tokens_sent(n) and ids not in ancestors(n, boundary | {ids})

    x = nearest_ancestors(tok.input, is_x, stop=[ids, *weights_pre])
    if len(x) != 1:
        raise Mismatch(tok.node, SkipCode.NO_TOKEN_ROWS, f"could not find the token rows x [{tokens}, {hidden}] "
                       f"the sent rows are gathered from (found {len(x)} candidates)")
    x = x[0]
    symbols = sample_bindings(tokens, tok.input)
    try:
        num_tokens, width = concrete(tokens, symbols), concrete(hidden, symbols)
    except ValueError as e:
        raise Mismatch(tok.node, SkipCode.UNSAMPLED_SIZE, f"token count or hidden size cannot be sampled: {e}")
    region = EPRegion(module_path(tok.node), counts, tok, comb, x, ids, None, num_tokens, top_k, width,
                      num_experts, num_ranks, tok.group_name, _expert_input(tok, counts, comb), None, None, None,
                      weights_on_sent_rows=bool(weights_pre), token_count=tokens, symbols=symbols)
    region.tokens_out, region.topk_weights = _find_tokens_out(region, weights_pre, is_weights, hidden)
    region.module = module_path(region.tokens_out) or region.module
    out_shape = shape_exprs(region.tokens_out)
    if symbols and len(out_shape) != 2 and not (len(out_shape) == len(shape_exprs(x))
                                                and all(map(same, out_shape, shape_exprs(x)))):
        raise Mismatch(region.tokens_out, SkipCode.DYNAMIC_RESULT_SHAPE,
                       f"result shaped {list(out_shape)} with a dynamic token count is neither "
                       "[T, D] nor shaped like x")
    return region


def _describe(node) -> str:
    t = tensor_meta(node)
    return "a non-tensor" if t is None else f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _find_tokens_out(region: EPRegion, weights_pre: set[fx.Node], is_weights, hidden) -> tuple[fx.Node, fx.Node]:
    """The first T x D value after the combine computable from (returned rows, ids, x, one weight tensor)
    alone and used only outside the region, and that weight tensor."""
    comb, ids, x, tok = region.combine_a2a, region.topk_ids, region.x, region.token_a2a
    escapes = []
    for n in later_values(comb.result, comb.node, lambda n: token_rows(n, region.token_count, hidden),
                          _MAX_RESULT_CANDIDATES):
        weights = weights_pre | set(nearest_ancestors(n, is_weights, stop=[ids, x, comb.result]))
        if len(weights) != 1:
            continue
        try:
            backward_slice([n], {comb.result, ids, x, *weights}, symbols=region.symbols)
        except NotEvaluable:
            continue
        (weights,) = weights
        escape = _escape(tok, n, stop={x, ids, weights, region.counts_a2a.node})
        if escape is None:
            return n, weights
        escapes.append(escape)
    if escapes:
        raise Mismatch(tok.node, SkipCode.VALUE_ESCAPES, escapes[0], stage=1)
    raise Mismatch(comb.node, SkipCode.NO_RESULT,
                   f"no [{region.token_count}, {hidden}] result computed from the returned rows, expert "
                   "ids and one routing-weight tensor")


def result_readers(tokens_out: fx.Node) -> list[fx.Node]:
    """Who reads the region's result: the node's users, and when the result is an in-place write into a buffer
    (`out.index_add_(...)` as a statement), the buffer's readers after the write."""
    readers = list(tokens_out.users)
    buffer = written_buffer(tokens_out)
    if buffer is not None:
        order = graph_order(tokens_out.graph)
        readers += [u for u in buffer.users if order[u] > order[tokens_out]]
    return readers


def _escape(tok: AllToAll, tokens_out: fx.Node, stop: set[fx.Node]) -> str | None:
    """Why a value between the token all-to-all and the result is used outside the region (None: it is not)."""
    inner = between({tok.node}, tokens_out, stop) - {tokens_out}
    buffer = written_buffer(tokens_out)  # an in-place result: the buffer's later readers read the result
    buffer_readers = set(result_readers(tokens_out)) - set(tokens_out.users)
    for n in inner:
        for u in n.users:
            # a host scalar read only by runtime guards (the graph's output is a real use)
            only_guarded = u.op != "output" and tensor_meta(u) is None and bool(u.users) \
                and not u.users.keys() - {g for g in u.users if is_guard(g)}
            reads_result = u is tokens_out or (n is buffer and u in buffer_readers)
            if u in inner or reads_result or is_guard(u) or only_guarded or is_unused(u):
                continue
            return f"{n.name} (inside the EP region) is also used by {u.name}, outside it"
    return None


def _expert_input(tok: AllToAll, counts: AllToAll, comb: AllToAll) -> fx.Node:
    """The received rows as the experts read them: the latest value computed from the received rows and counts
    alone through which every such value the experts (or anything else) read passes. ep_checks proves it is
    a permutation of the received rows grouping them by local expert (gather, index_select, split + cat ...)."""
    received = {tok.result, counts.result}
    downstream = between({tok.result}, comb.input, stop=received) - {comb.input}
    # the sent counts may be read too (host splits taken off one stack of sent and received sums, as transformers
    # does); multi-output nodes (split, chunk, sort) carry the walk but are no candidates
    local = {n for n in downstream if _computable_from(n, received | {counts.input})}
    local.add(tok.result)
    frontier = {n for n in local if tensor_meta(n) is not None
                and any(u not in local and not _reads_metadata(u, n) for u in n.users)}
    order = graph_order(tok.node.graph)
    for candidate in sorted((n for n in local if tensor_meta(n) is not None), key=order.__getitem__, reverse=True):
        if not _reaches_avoiding(tok.result, frontier - {candidate}, avoid=candidate, within=local):
            return candidate
    return tok.result


def _computable_from(node: fx.Node, leaves: set[fx.Node]) -> bool:
    try:
        backward_slice([node], leaves, symbols=example_sizes(node))  # computable at any size
    except NotEvaluable:
        return False
    return True


def _reads_metadata(user: fx.Node, node: fx.Node) -> bool:
    from .evaluate import reads_only_metadata

    return reads_only_metadata(user, node) or tensor_meta(user) is None


def _reaches_avoiding(start: fx.Node, targets: set[fx.Node], avoid: fx.Node, within: set[fx.Node]) -> bool:
    """Some target is reachable from start through `within` without passing `avoid`."""
    if start is avoid:
        return False
    seen, frontier = {start}, [start]
    while frontier:
        n = frontier.pop()
        if n in targets:
            return True
        for u in data_users(n):
            if u in within and u is not avoid and u not in seen:
                seen.add(u)
                frontier.append(u)
    return False
