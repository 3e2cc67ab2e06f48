"""deepep: expert-parallel all-to-all regions -> moepass::ep_dispatch / ep_combine (DeepEP semantics).

A region (see moepass.analysis.ep_region) sends every (token, expert) slot as its own row and scatters the
returned rows back to tokens. DeepEP sends a token once per destination rank and sums its rows on the
way back, without weights. The rewrite, per region:

    recv_x, recv_idx, recv_w, counts, handle = ep_dispatch(x, topk_ids, topk_weights)
    pair_row, pair_slot = ep_expert_major_pairs(recv_idx)        # (row, local expert), expert-major
    y = experts(recv_x[pair_row] [* w, when the original weighted before the experts], counts)   # unchanged
    rows = zeros.index_add(0, pair_row, y.float() [* w, when it weighted after the experts])
    result = ep_combine(rows, handle)                              # replaces the original [T, D] result

Routing weights are applied where the original applied them. Products and the per-token sum stay in
fp32 as in the original; on the reference backend the combine also sums in fp32 (so a token whose
experts span two ranks sums in the same order as before), DeepEP combines in the model dtype.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from moepass.analysis.collectives import is_autograd_function, is_collective
from moepass.analysis.dtensors import is_dtensor, local_value
from moepass.analysis.ep_parts import EPRegion
from moepass.analysis.ep_region import find_ep_regions, result_readers
from moepass.analysis.scopes import graph_scopes
from moepass.analysis.emit import Emitter, fake_value
from moepass.analysis.graph import between, example_value, graph_order, is_guard, tensor_meta, written_buffer
from moepass.skips import Reason, SkipCode

NAME = "deepep"
log = logging.getLogger(__name__)


# the bodies a region can sit in whole; an autograd.Function's all-to-all is lifted into its caller's graph
_REGION_SCOPES = ("top", "activation checkpoint", "wrap", "nested compile region")


def run(gm: fx.GraphModule, config, record) -> None:
    for scope in graph_scopes(gm):
        if scope.kind in _REGION_SCOPES:
            with record.in_scope(scope):
                _run_scope(scope.gm, config, record)


def _run_scope(gm: fx.GraphModule, config, record) -> None:
    import moepass.ops.ep  # noqa: F401  (registers the EP ops)
    from moepass.ops.ep.dispatch_combine import choose_ep_backend

    regions, skips = find_ep_regions(gm)
    for s in skips:
        record.skip(s.node, s.module, Reason(s.code, s.reason))
    chosen = []
    for region in regions:
        shape_env = getattr(_fake_mode(region), "shape_env", None)
        if shape_env is not None and not shape_env.allow_dynamic_output_shape_ops:
            record.skip(region.token_a2a.node, region.module, Reason(
                SkipCode.NO_DYNAMIC_SHAPES, "torch._dynamo.config.capture_dynamic_output_shape_ops is off "
                "in this frame's trace (moepass.dynamo_flags traced it again without it): the received row count could "
                "not be traced"))
            continue
        requested = config.section("deepep").backend
        backend, why = choose_ep_backend(region.group_name, tensor_meta(region.x).device, region.num_experts,
                                         requested)
        if backend == "deepep" and tensor_meta(region.x).dtype != torch.bfloat16:
            if requested == "deepep":
                dtype = tensor_meta(region.x).dtype
                record.skip(region.token_a2a.node, region.module, Reason(
                    SkipCode.DEEPEP_BF16, f"DeepEP takes bfloat16 tokens, x is {dtype}; use deepep.backend=reference"))
                continue
            backend, why = "reference", f"x is {tensor_meta(region.x).dtype}; DeepEP takes bfloat16 tokens"
        record.implementations[backend] = why
        chosen.append((region, backend, region.token_a2a.node.name))
    kept_counts = rewrite_regions(gm, [(region, backend) for region, backend, _ in chosen])
    for region, backend, anchor in chosen:
        record.replace(anchor, region.module, "moepass.ep_dispatch + moepass.ep_combine",
                       _detail(region, backend, region.counts_a2a.node in kept_counts))
    if chosen:
        gm.delete_all_unused_submodules()  # the autograd.Function bodies of replaced all-to-alls
    log.debug("deepep: %d regions rewritten, %d all-to-alls left alone", len(record.rewrites), len(record.skipped))


def _detail(region: EPRegion, backend: str, kept_counts: bool) -> str:
    x = tensor_meta(region.x)
    checked_at = f" (checked at T={region.num_tokens})" if region.symbols else ""
    detail = (f"x[{region.token_count},{tensor_meta(region.x).shape[-1]}] {str(x.dtype).removeprefix('torch.')}, top-{region.top_k} of "
              f"{region.num_experts} experts over {region.group_size} ranks (group {region.group_name!r}), "
              f"weights {region.weights_applied.replace('_', ' ')}, backend={backend}; "
              f"a2a forms {region.token_a2a.form}/{region.combine_a2a.form}; "
              f"checked on {region.checked_routings} routings{checked_at}")
    for pinned in region.pinned_lengths:
        detail += f"; {pinned.describe()}, asserted at run time"
    if kept_counts:
        detail += "; counts all-to-all kept (its split sizes are also used outside the region)"
    return detail


# ---------------------------------------------------------------- the rewrite


def _local(emit: Emitter, node: fx.Node) -> fx.Node:
    """A DTensor operand's local shard (the EP analysis identified the region on local data), else the node."""
    return emit("to_local", node, method=True) if is_dtensor(example_value(node)) else node


def _fake_mode(region: EPRegion):
    value = local_value(example_value(region.x))
    return getattr(value, "fake_mode", None)


def rewrite_regions(gm: fx.GraphModule, regions: list[tuple[EPRegion, str]]) -> set[fx.Node]:
    """Replace checked regions in place, then erase what became dead.

    Returns the counts all-to-alls that had to stay (their results are also used outside their region).
    """
    anchors = {n for region, _ in regions for n in _anchors(region)}
    live_before = live_nodes(gm.graph, anchors)
    for region, backend in regions:
        _rewrite_region(gm, region, backend)
    _erase_dead(gm.graph, live_before, anchors)
    remaining = set(gm.graph.nodes)
    for region, _ in regions:
        if region.token_a2a.node in remaining or region.combine_a2a.node in remaining:
            # the finder's escape check should make this impossible; fail loudly rather than run both paths
            raise RuntimeError(f"deepep: token or combine all-to-all of {region.module} still live after the rewrite")
    return {region.counts_a2a.node for region, _ in regions} & remaining


# marks the runtime checks the rewrite inserts: they stay, with what they read, even where nothing else reads that
_REGION_CHECK = "moepass_region_check"


def _assert_ids_in_range(graph: fx.Graph, emit: Emitter, region: EPRegion) -> None:
    """For each bincount whose length the analysis proved E from its ids: assert at run time that the ids lie in
    [0, E), which is what the rewrite relies on (it dispatches to E experts) and what makes the length E.

    A check of the ids' values, not of the bincount's size: the analysis already told the shape environment the
    size is E (Inductor checks the size where the bincount still runs), so `size == E` would be traced as True and
    dropped with the bincount, which the rewrite usually leaves dead; this one is fused into one small reduction,
    with no host sync (an async device assert on GPU), and raises where the original bincount would have grown."""
    aten = torch.ops.aten
    for pinned in region.pinned_lengths:
        with graph.inserting_before(pinned.bincount):
            ids = _local(emit, pinned.bincount.args[0])
            in_range = emit(aten.logical_and.default, emit(aten.ge.Scalar, ids, 0),
                            emit(aten.lt.Scalar, ids, pinned.length))
            check = emit(aten._assert_async.msg, emit(aten.all.default, in_range),
                         f"moepass deepep: the ids counted by bincount `{pinned.bincount.name}` must lie in [0, "
                         f"{pinned.length}) (the EP rewrite of {region.module or 'the region'} dispatches to "
                         f"{pinned.length} experts)")
        check.meta[_REGION_CHECK] = True


def _rewrite_region(gm: fx.GraphModule, region: EPRegion, backend: str) -> None:
    graph = gm.graph
    emit = Emitter(graph, _fake_mode(region))
    _assert_ids_in_range(graph, emit, region)
    x_meta, sent_meta = tensor_meta(region.x), tensor_meta(region.token_a2a.input)
    with graph.inserting_before(region.token_a2a.node):
        # the ops take [T, K] ids and weights and [T, D] rows; models may hold [B, S, K] and [B, S, D]
        # (or DTensors sharded over tokens: a rank dispatches its own shard)
        ids = _as_rows(emit, _local(emit, region.topk_ids))
        if tensor_meta(ids).dtype != torch.int64:
            ids = emit("to", ids, torch.int64, method=True)
        weights = _as_rows(emit, _local(emit, region.topk_weights))
        if tensor_meta(weights).dtype != torch.float32:
            weights = emit("float", weights, method=True)
        x = _as_rows(emit, _local(emit, region.x))
        if x_meta.dtype != sent_meta.dtype:  # the original sent rows cast to this dtype
            x = emit("to", x, sent_meta.dtype, method=True)
        dispatched = emit(torch.ops.moepass.ep_dispatch.default, x, ids, weights, region.num_experts,
                          region.group_size, region.group_name, backend)
        recv_x, recv_idx, recv_w, recv_counts, handle = (emit(operator.getitem, dispatched, i) for i in range(5))
        pairs = emit(torch.ops.moepass.ep_expert_major_pairs.default, recv_idx, region.num_local_experts)
        pair_row, pair_slot = emit(operator.getitem, pairs, 0), emit(operator.getitem, pairs, 1)
        # x[idx] and a fp32 index_add: the code timed on 2xH200 (examples/results/ep_dispatch_2xH200.json, path
        # deepep_index_add); Inductor fuses it well. Dedicated ops measured slower (see .notes/deepep_pass.md)
        pair_in = emit(operator.getitem, recv_x, pair_row)
        pair_w = emit("unsqueeze", emit(operator.getitem, emit("reshape", recv_w, -1, method=True), pair_slot),
                      -1, method=True)
        if region.weights_applied == "before_experts":
            pair_in = emit("to", emit(operator.mul, emit("float", pair_in, method=True), pair_w), sent_meta.dtype,
                           method=True)
        counts = recv_counts
        if region.expert_counts is not None and tensor_meta(region.expert_counts).dtype != torch.int64:
            counts = emit("to", counts, tensor_meta(region.expert_counts).dtype, method=True)
    region.expert_input.replace_all_uses_with(pair_in)
    if region.expert_counts is not None:  # None: one local expert reading no group sizes
        region.expert_counts.replace_all_uses_with(counts)
    # the experts now see P pair rows instead of the R received rows: their fake values follow
    experts = between({pair_in, counts}, region.expert_output)
    for n in sorted(experts, key=graph_order(graph).__getitem__):
        if n.op in ("call_function", "call_method"):
            fake_value(n, emit.fake_mode)

    out = region.tokens_out
    with graph.inserting_before(out):
        rows = emit("float", region.expert_output, method=True)
        if region.weights_applied == "after_experts":
            rows = emit(operator.mul, rows, pair_w)
        summed = emit(torch.index_add, emit(torch.zeros_like, recv_x, dtype=torch.float32), 0, pair_row, rows)
        if backend != "reference":  # DeepEP's combine kernels take the model dtype
            summed = emit("to", summed, x_meta.dtype, method=True)
        combined = emit(torch.ops.moepass.ep_combine.default, summed, handle, region.group_size, region.group_name,
                        backend)
        combined_dtype = torch.float32 if backend == "reference" else x_meta.dtype
        if tensor_meta(out).dtype != combined_dtype:
            combined = emit("to", combined, tensor_meta(out).dtype, method=True)
        if tensor_meta(out).dim() != 2:  # [B, S, D]: its sizes are x's, static or symbolic (ep_region checks)
            combined = emit("view_as", combined, region.x, method=True) if _same_shape(out, region.x) \
                else emit("reshape", combined, tuple(tensor_meta(out).shape), method=True)
    for n in (dispatched, combined):
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in out.meta:
                n.meta.setdefault(key, out.meta[key])
    buffer = written_buffer(out)  # an in-place result (`out.index_add_(...)` as a statement): its later readers
    for reader in [u for u in result_readers(out) if u not in out.users]:
        reader.replace_input_with(buffer, combined)
    out.replace_all_uses_with(combined)


def _as_rows(emit, node: fx.Node) -> fx.Node:
    """`node` as [rows, width] (a view when it is [B, S, width]; sizes may be symbolic)."""
    return node if tensor_meta(node).dim() == 2 else emit("flatten", node, 0, -2, method=True)


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    from moepass.analysis.symbols import same, shape_exprs

    sa, sb = shape_exprs(a), shape_exprs(b)
    return len(sa) == len(sb) and all(map(same, sa, sb))


def _anchors(region: EPRegion) -> set[fx.Node]:
    return {region.counts_a2a.node, region.token_a2a.node, region.combine_a2a.node}


# ---------------------------------------------------------------- dead code after the rewrite


def live_nodes(graph: fx.Graph, anchors: set[fx.Node]) -> set[fx.Node]:
    """Nodes the graph's outputs and side effects need.

    Writes into a buffer live while the buffer does; a runtime guard (`_assert_scalar`) lives while
    the host values it checks are needed for something else; collectives and `anchors` are never
    needed for their own sake; the checks a rewrite inserted are.
    """
    live, stack = set(), []

    def mark(n):
        if n not in live:
            live.add(n)
            stack.append(n)

    for n in graph.nodes:
        if n.op in ("placeholder", "output") or n.meta.get(_REGION_CHECK):
            mark(n)
        elif n.op == "call_function" and n not in anchors and not is_collective(n) and not is_guard(n) \
                and not is_autograd_function(n) and written_buffer(n) is None and n.is_impure():
            mark(n)
    while True:
        while stack:
            for a in stack.pop().all_input_nodes:
                mark(a)
        for n in graph.nodes:
            if n in live:
                continue
            buffer = written_buffer(n)
            if (buffer is not None and buffer in live) or (is_guard(n) and _guard_sources(n) <= live):
                mark(n)
        if not stack:
            return live


def _guard_sources(guard: fx.Node) -> set[fx.Node]:
    """The host scalars a guard checks: `u0` of `_assert_scalar(u0 >= 0)`."""
    sources, frontier = set(), list(guard.all_input_nodes)
    while frontier:
        n = frontier.pop()
        if isinstance(example_value(n), torch.Tensor) or n.op == "placeholder":
            sources.add(n)
            continue
        tensor_inputs = [a for a in n.all_input_nodes if isinstance(example_value(a), torch.Tensor)]
        if tensor_inputs or not n.all_input_nodes:
            sources.add(n)
        else:
            frontier.extend(n.all_input_nodes)
    return sources


def _erase_dead(graph: fx.Graph, live_before: set[fx.Node], anchors: set[fx.Node]) -> None:
    """Erase what the rewrite made dead (and nothing that was already unused before it)."""
    live = live_nodes(graph, anchors)

    def erase(n):
        for u in list(n.users):  # a dead node's users are dead too (one may have gone with another already)
            if not getattr(u, "_erased", False):
                erase(u)
        graph.erase_node(n)

    for n in reversed(list(graph.nodes)):
        if n in live_before and n not in live and not getattr(n, "_erased", False):
            erase(n)
