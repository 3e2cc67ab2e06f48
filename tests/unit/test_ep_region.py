"""find_ep_regions on the Dynamo graph of one tiny EP MoE and of small changes to it, one per skip reason.

As PyTorch's micro-pipeline TP tests do: a single process on a fake process group, graphs captured and
never run (the fake group's collectives return garbage; tracing runs on fake tensors, so `.tolist()` of
the received counts is an unbacked SymInt, never garbage), and assertions on the finder's match records:
the EPRegion's fields for the correct MoE, and for each change the one RegionSkip, its anchor and reason.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

from moepass.dynamo_flags import FLAGS
from moepass.analysis.ep_region import find_ep_regions
from moepass.report.left_alone import explain

TOKENS, HIDDEN, EXPERTS, TOP_K, RANKS = 16, 64, 8, 2, 2

CHANGES = {
    None, "weights_before_experts", "without_ep", "extra_all_to_all", "counts_not_exchanged", "float_counts",
    "uneven_counts_splits", "argmax_top1", "two_token_sources", "value_escapes", "value_escapes_to_output",
    "expert_scale_after_combine", "scaled_send", "capacity_drops_slots", "input_splits_wrong_layout",
    "sorted_descending", "output_splits_wrong_layout", "static_receive_size", "receiver_pads_groups",
    "no_regroup", "no_unpermute", "echo", "group_sizes_wrong_layout", "dense_experts",
    "experts_read_received_shape", "mean_combine", "scale_experts", "scale_experts_by_group_sizes",
}


@pytest.fixture(scope="module", autouse=True)
def ep_capture_flags():
    """The graphs here are captured by the tests' own backends, which moepass gives no flags: set what its frames get."""
    with torch._dynamo.config.patch(FLAGS):
        yield


@pytest.fixture(scope="module", autouse=True)
def fake_process_group():
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=RANKS)
    yield
    dist.destroy_process_group()


class _Captured(Exception):
    """Raised instead of running the captured graph."""


def capture(fn, x) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, _):
        graphs.append(gm)

        def never_run(*args):
            raise _Captured

        return never_run

    torch._dynamo.reset()  # every change is the same code object: no cache hits, no recompile limit
    with pytest.raises(_Captured):
        torch.compile(fn, backend=backend, fullgraph=True)(x)
    (gm,) = graphs
    return gm


def ep_moe(change=None, *, hidden=HIDDEN, top_k=TOP_K, experts=EXPERTS):
    """One EP MoE block on x [T, D]: softmax top-k router, one_hot counts, funcol all-to-alls, argsort dispatch,
    torch._grouped_mm experts, index_copy un-permute, index_add weighted combine; `change` alters one step."""
    assert change in CHANGES, change
    group, local = dist.group.WORLD, experts // RANKS
    gen = torch.Generator().manual_seed(0)
    router = torch.randn(hidden, experts, generator=gen)
    w = torch.randn(local, hidden, hidden, generator=gen).to(torch.bfloat16)
    expert_scale = torch.randn(experts, generator=gen)
    send_scale = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    position = torch.randn(TOKENS, hidden, generator=gen).to(torch.bfloat16)

    def all_to_all(t, out_splits, in_splits):
        return t if change == "without_ep" else funcol.all_to_all_single_autograd(t, out_splits, in_splits, group)

    def run_experts(rows, group_sizes):
        if change == "dense_experts":
            return rows @ w[0]
        # torch._grouped_mm needs 16-byte row strides: narrow rows get a scale per expert instead
        if hidden % 8 or change in ("scale_experts", "scale_experts_by_group_sizes"):
            total = int(group_sizes.sum()) if change == "scale_experts_by_group_sizes" else rows.shape[0]
            expert_of_row = torch.arange(local).repeat_interleave(group_sizes, output_size=total)
            return rows * expert_scale[expert_of_row].unsqueeze(-1).to(rows.dtype)
        return torch._grouped_mm(rows, w, offs=group_sizes.cumsum(0).to(torch.int32))

    def moe(x):
        scores = (x.float() @ router).softmax(-1)
        if change == "argmax_top1":
            (weights, ids), k = scores.max(-1), 1
        else:
            (weights, ids), k = scores.topk(top_k, dim=-1), top_k
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True, descending=change == "sorted_descending")
        counts = F.one_hot(flat, experts).sum(0)
        if change == "capacity_drops_slots":  # at most 3 slots per expert, as GShard/Switch do
            position_in_expert = torch.arange(flat.shape[0]) - (counts.cumsum(0) - counts)[flat[order]]
            order, counts = order[position_in_expert < 3], counts.clamp(max=3)
        token = order // k
        if change == "float_counts":
            counts = counts.float()
        if change in ("counts_not_exchanged", "without_ep"):  # every rank assumed to route like this one
            recv_counts = counts
        elif change == "uneven_counts_splits":
            recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, [3, 5], [3, 5], group))
        else:
            recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group))
        if change == "float_counts":
            counts, recv_counts = counts.long(), recv_counts.long()
        if change == "input_splits_wrong_layout":
            in_splits = counts.view(local, RANKS).sum(0).tolist()
        else:
            in_splits = counts.view(RANKS, local).sum(1).tolist()
        if change == "output_splits_wrong_layout":
            out_splits = recv_counts.view(local, RANKS).sum(0).tolist()
        else:
            out_splits = recv_counts.view(RANKS, local).sum(1).tolist()

        send = x[token]
        if change == "weights_before_experts":
            send = (send.float() * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        elif change == "two_token_sources":
            send = send + position[token]
        elif change == "scaled_send":
            send = send * send_scale
        received = all_to_all(send, out_splits, in_splits)

        rows_received = RANKS * TOKENS * k if change == "static_receive_size" else received.shape[0]
        local_id = torch.arange(local).repeat(RANKS).repeat_interleave(recv_counts, output_size=rows_received)
        perm = torch.argsort(local_id, stable=True)
        if change == "group_sizes_wrong_layout":
            group_sizes = recv_counts.view(local, RANKS).sum(1)
        else:
            group_sizes = recv_counts.view(RANKS, local).sum(0)
        if change == "receiver_pads_groups":  # torchao permute_and_pad: groups padded to 8 rows on the receiver
            padded_sizes = (group_sizes + 7) // 8 * 8
            index = _padded_index(recv_counts, padded_sizes, local, RANKS * TOKENS * k)
            with_zero_row = torch.vstack((received, received.new_zeros((hidden,))))  # index -1 reads it
            y = run_experts(with_zero_row[index], padded_sizes)
            back = y.new_empty(with_zero_row.shape)
            back[index] = y
            back = back[:-1]
        elif change == "no_regroup":
            y = run_experts(received, group_sizes)
            back = y
        elif change == "echo":
            back = received
        else:
            expert_input = received[perm]
            y = run_experts(expert_input, group_sizes)
            if change == "experts_read_received_shape":
                y = y.view(received.shape)
            back = y if change == "no_unpermute" else torch.zeros_like(y).index_copy(0, perm, y)
        returned = all_to_all(back, in_splits, out_splits)

        rows = returned.float()
        if change != "weights_before_experts":
            rows = rows * weights.reshape(-1)[order].unsqueeze(-1)
        if change == "expert_scale_after_combine":
            rows = rows * expert_scale[flat[order]].unsqueeze(-1)
        if change == "mean_combine":
            out = torch.zeros(TOKENS, hidden).scatter_reduce(0, token.unsqueeze(-1).expand(-1, hidden), rows,
                                                             reduce="mean", include_self=False)
        else:
            out = torch.zeros(TOKENS, hidden).index_add_(0, token, rows)
        out = out.to(x.dtype)
        if change == "value_escapes":
            return out + y.float().mean().to(x.dtype)
        if change == "value_escapes_to_output":
            return out, received
        if change == "extra_all_to_all":  # e.g. a sequence-parallel exchange after the MoE
            return funcol.wait_tensor(funcol.all_to_all_single(out, None, None, group))
        return out

    return moe


def _padded_index(recv_counts, padded_sizes, local, max_rows):
    """For each row of the padded expert-major layout, the received row it holds (-1: padding)."""
    lens = recv_counts.view(RANKS, local).t().reshape(-1)
    starts = (recv_counts.cumsum(0) - recv_counts).view(RANKS, local).t().reshape(-1)
    padded_starts = (padded_sizes.cumsum(0) - padded_sizes).repeat_interleave(RANKS)
    within_expert = (lens.view(local, RANKS).cumsum(1) - lens.view(local, RANKS)).reshape(-1)
    segment = torch.arange(lens.shape[0]).repeat_interleave(lens)
    in_segment = torch.arange(segment.shape[0]) - (lens.cumsum(0) - lens)[segment]
    index = torch.full((max_rows + local * 8,), -1, dtype=torch.int64)
    index[padded_starts[segment] + within_expert[segment] + in_segment] = starts[segment] + in_segment
    return index


def _x(hidden=HIDDEN):
    return torch.randn(TOKENS, hidden, dtype=torch.bfloat16)


def _all_to_alls(gm) -> list[torch.fx.Node]:
    """The graph's all_to_all_single calls in order: counts, tokens, tokens back (and any extra one)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and "all_to_all_single" in str(n.target)]


def _only(nodes, target) -> torch.fx.Node:
    (node,) = [n for n in nodes if n.target == target]
    return node


# ---------------------------------------------------------------- regions found


@pytest.mark.parametrize("change, weights_applied", [(None, "after_experts"),
                                                     ("weights_before_experts", "before_experts")])
def test_correct_region_is_found_with_its_parts(change, weights_applied):
    gm = capture(ep_moe(change), _x())
    regions, skips = find_ep_regions(gm)
    assert skips == []
    (region,) = regions
    counts_a2a, token_a2a, combine_a2a = _all_to_alls(gm)
    assert (region.counts_a2a.node, region.token_a2a.node, region.combine_a2a.node) == \
        (counts_a2a, token_a2a, combine_a2a)
    assert (region.num_tokens, region.hidden, region.num_experts, region.top_k) == (TOKENS, HIDDEN, EXPERTS, TOP_K)
    assert (region.group_size, region.num_local_experts) == (RANKS, EXPERTS // RANKS)
    assert region.group_name == dist.group.WORLD.group_name
    assert region.weights_applied == weights_applied
    assert region.checked_routings >= 3
    nodes = list(gm.graph.nodes)
    assert region.x.op == "placeholder" and region.x.name == "l_x_"
    topk = _only(nodes, "topk")
    assert region.topk_ids.args == (topk, 1) and region.topk_weights.args == (topk, 0)
    grouped_mm = _only(nodes, torch._grouped_mm)
    assert region.expert_output is grouped_mm
    assert region.expert_input is grouped_mm.args[0]  # received[perm]
    assert region.expert_input.args[0] is region.token_a2a.result
    # the rows per local expert, of which the experts' offsets are the cumsum
    assert region.expert_counts.target == "sum" and region.expert_counts.args[1:] == (0,)
    assert region.tokens_out is _only(nodes, "index_add_")


def test_region_next_to_an_unrelated_all_to_all():
    gm = capture(ep_moe("extra_all_to_all"), _x())
    regions, skips = find_ep_regions(gm)
    *region_a2as, extra = _all_to_alls(gm)
    assert [r.token_a2a.node for r in regions] == [region_a2as[1]]
    assert [(s.node, s.reason) for s in skips] == [
        (extra, "all-to-all is not part of a dispatch/combine pair (its split sizes are fixed at trace time, not "
                "routed counts: no token exchange of an MoE, or a capacity-padded one, which sends padding where "
                "DeepEP sends only the routed (token, expert) slots)")]


def test_graph_without_all_to_all_has_no_regions_and_no_skips():
    assert find_ep_regions(capture(ep_moe("without_ep"), _x())) == ([], [])


# ---------------------------------------------------------------- one skip per reason

# (change, ep_moe keywords, the all-to-all the skip names, what its reason says)
SKIPS = [
    pytest.param("counts_not_exchanged", {}, "tokens",
                 "no counts all-to-all found upstream of the token all-to-all's split sizes",
                 id="counts_not_exchanged"),
    pytest.param("float_counts", {}, "counts",
                 "counts all-to-all does not send a static integer count per expert (sends float32[8])",
                 id="float_counts"),
    pytest.param("uneven_counts_splits", {}, "counts", "are not split evenly over 2 ranks",
                 id="uneven_counts_splits"),
    pytest.param("argmax_top1", {}, "counts", "could not find the top-k expert ids [T, K]", id="argmax_top1"),
    pytest.param("two_token_sources", {}, "tokens",
                 "could not find the token rows x [16, 64] the sent rows are gathered from (found 2 candidates)",
                 id="two_token_sources"),
    pytest.param("value_escapes", {}, "tokens", "(inside the EP region) is also used by", id="value_escapes"),
    pytest.param("expert_scale_after_combine", {}, "combine",
                 "no [16, 64] result computed from the returned rows, expert ids and one routing-weight tensor",
                 id="expert_scale_after_combine"),
    # a fixed bar (1 + 8 digit columns), not one that depends on this rank's token count: ranks must agree
    pytest.param(None, {"hidden": 8}, "tokens", "hidden size 8 < 9: too narrow to check which token each row",
                 id="narrow_hidden"),
    pytest.param("scaled_send", {}, "tokens",
                 "rows or counts sent are not computed from x, expert ids and weights alone", id="scaled_send"),
    pytest.param("capacity_drops_slots", {}, "counts", "counts sent are not the number of top-k slots per expert",
                 id="capacity_drops_slots"),
    pytest.param("input_splits_wrong_layout", {}, "tokens",
                 "input split sizes are not the per-rank sums of the expert counts", id="input_splits_wrong_layout"),
    pytest.param("sorted_descending", {}, "tokens",
                 "rows sent are not x[token] (or x[token] * its routing weight) for every (token, expert) slot, "
                 "sorted by expert", id="sorted_descending"),
    pytest.param("output_splits_wrong_layout", {}, "tokens",
                 "output split sizes are not the per-rank sums of the received counts",
                 id="output_splits_wrong_layout"),
    # a static output_size raises on the samples' row counts; the reason carries the error
    pytest.param("static_receive_size", {}, "tokens",
                 "the experts' input is not computed from the received rows and counts alone: local_id raised",
                 id="static_receive_size"),
    pytest.param("receiver_pads_groups", {}, "tokens", "the experts' input is not a permutation of the received rows",
                 id="receiver_pads_groups"),
    pytest.param("no_regroup", {}, "tokens", "the experts' input does not group the received rows by local expert",
                 id="no_regroup"),
    pytest.param("no_unpermute", {}, "combine",
                 "rows sent back are not the experts' output un-permuted to the received order", id="no_unpermute"),
    # with one expert per rank any order is grouped: the echo gets as far as the rows sent back
    pytest.param("echo", {"experts": RANKS}, "combine",
                 "the rows sent back are not computed from the expert-major received rows", id="echo"),
    pytest.param("group_sizes_wrong_layout", {}, "tokens",
                 "the experts' group sizes are not the received rows per local expert", id="group_sizes_wrong_layout"),
    pytest.param("dense_experts", {}, "tokens", "the experts are given no group sizes derived from the received counts",
                 id="dense_experts"),
    pytest.param("experts_read_received_shape", {}, "tokens",
                 "the experts read the received rows other than through the expert-major rows",
                 id="experts_read_received_shape"),
    pytest.param("mean_combine", {}, "combine",
                 "result is not the sum of each token's K returned rows (routing weights applied after the experts)",
                 id="mean_combine"),
]


@pytest.mark.parametrize("change, sizes, anchor, reason", SKIPS)
def test_region_is_skipped_with_its_reason(change, sizes, anchor, reason):
    gm = capture(ep_moe(change, **sizes), _x(sizes.get("hidden", HIDDEN)))
    regions, skips = find_ep_regions(gm)
    assert regions == []
    (skip,) = skips
    assert reason in skip.reason
    documented = explain(skip)  # its code: the left-alone table of docs/passes.md has it
    assert documented is not None and documented.passes == "deepep" and documented.phrase in skip.reason, skip
    a2as = _all_to_alls(gm)
    expected = {"counts": a2as[0], "tokens": a2as[-2], "combine": a2as[-1]}[anchor]
    assert skip.node is expected and skip.module == ""


# ---------------------------------------------------------------- cases these tests first found wrong


def test_value_returned_from_the_graph_escapes_the_region():
    """A received value the graph also returns is a use outside the region."""
    regions, skips = find_ep_regions(capture(ep_moe("value_escapes_to_output"), _x()))
    assert regions == []
    (skip,) = skips
    assert "(inside the EP region) is also used by" in skip.reason


def test_one_expert_per_rank_sending_its_output_straight_back_is_found():
    """With one expert per rank the received order is already expert-major: no permutation on either side."""
    regions, skips = find_ep_regions(capture(ep_moe("no_regroup", experts=RANKS), _x()))
    assert skips == []
    (region,) = regions
    assert region.expert_output is region.combine_a2a.input


def test_experts_reading_their_row_count_are_refused_with_that_reason():
    """`repeat_interleave(..., output_size=rows.shape[0])` gets the SymInt sum of the output splits, which the
    rewrite cannot supply (its expert rows come from the pair list): refused, saying what to change."""
    regions, skips = find_ep_regions(capture(ep_moe("scale_experts"), _x()))
    assert regions == []
    (skip,) = skips
    assert "read the received row count" in skip.reason and "group_sizes.sum()" in skip.reason
    # and the fix it names works
    (region,), skips = find_ep_regions(capture(ep_moe("scale_experts_by_group_sizes"), _x()))
    assert skips == [] and region.weights_applied == "after_experts"


# ---------------------------------------------------------------- rows the experts can expect (routed_rows)


def _experts_input(gm) -> torch.fx.Node:
    (mm,) = [n for n in gm.graph.nodes if n.target is torch._grouped_mm]
    return mm.args[0]


def _sm90(monkeypatch):
    """recipe="auto" decides as on an H200 (the graph's tensors stay on the CPU)."""
    from moepass.device_arch import CudaDevice
    from moepass.recipes import auto

    monkeypatch.setattr(auto, "probe", lambda device, *_: CudaDevice("cuda:0", (9, 0), "NVIDIA H200"))


def test_experts_expect_the_rows_this_rank_sends():
    """Received rows are data dependent; on average a rank receives the T*K rows it sends."""
    from moepass.analysis.routed_rows import RoutedRows
    from moepass.analysis.graph import example_int, tensor_meta

    gm = capture(ep_moe(), _x())
    rows = _experts_input(gm)
    assert example_int(tensor_meta(rows).shape[0]) is None  # unbacked: nothing to decide on without this
    expected = RoutedRows(gm).expected(rows)
    assert expected.rows == TOKENS * TOP_K and _all_to_alls(gm)[1].name in expected.why
    assert RoutedRows(gm).expected(next(iter(gm.graph.nodes))) is None  # the input x: nothing upstream


def test_experts_expect_the_rows_ep_dispatch_sends_after_the_deepep_rewrite():
    from moepass.analysis.routed_rows import RoutedRows
    from moepass.options import Config
    from moepass.passes import deepep
    from moepass.report.records import PassRecord

    gm = capture(ep_moe(), _x())
    record = PassRecord("deepep")
    deepep.run(gm, Config.from_options({}), record)
    assert len(record.rewrites) == 1 and not _all_to_alls(gm)
    expected = RoutedRows(gm).expected(_experts_input(gm))
    assert expected.rows == TOKENS * TOP_K and "moepass::ep_dispatch" in expected.why


def test_auto_recipe_decides_grouped_gemms_after_an_exchange_on_the_rows_to_expect(monkeypatch):
    """Before: 'tokens per expert unknown at compile time', BF16 whatever the load. Now the reason names the
    expectation (here 32 rows over 4 local experts: too small for FP8, as the size rule says)."""
    from moepass.options import Config
    from moepass.passes import grouped_mm
    from moepass.report.records import PassRecord

    _sm90(monkeypatch)
    gm = capture(ep_moe(), _x())
    record = PassRecord("grouped_mm")
    grouped_mm.run(gm, Config.from_options({}), record)
    (skip,) = record.skipped
    assert "left in BF16: too small" in skip.reason and "tokens per expert=8 < 512" in skip.reason
    assert f"expected M={TOKENS * TOP_K}" in skip.reason and "all-to-all" in skip.reason


def test_at_671b_dims_with_ep2_the_experts_follow_the_table_measured_on_received_rows(monkeypatch):
    """The issue's EP=2 case: 64 experts (32 a rank), top-8. Received rows run the opaque op (unfused quantization), so
    auto reads the table's grouped_received curve: at 8,192 tokens a rank (2,048 rows per local expert on average)
    FP8 measured 0.97x there (1.07x on static rows): BF16; at 16,384 tokens a rank (4,096) 1.04x: FP8."""
    from moepass.recipes import auto, auto_table
    from moepass.analysis.routed_rows import ExpectedRows
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _sm90(monkeypatch)
    received = ShapeEnv().create_unbacked_symint()
    curve = {r["tokens_per_expert"]: r["speedup"] for r in
             json.loads(auto_table.SHIPPED.read_text())["grouped_received"] if r["dim"] == 7168}
    for k, n in ((7168, 2048), (7168, 4096), (2048, 7168)):  # w1, w1|w3 fused, w2
        for tokens_per_rank, per_expert in ((8192, 2048), (16384, 4096)):
            recipe, why = auto.choose_recipe("cuda", "grouped", received, k, n, experts=32,
                                                   expected=lambda t=tokens_per_rank: ExpectedRows(t * 8, "sent"))
            want = "fp8_rowwise" if curve[per_expert] >= auto_table.MIN_SPEEDUP else "bf16"
            assert recipe == want and f"expected M={tokens_per_rank * 8}" in why and "received" in why, why
            assert f"{curve[per_expert]:.2f}x" in why
    recipe, why = auto.choose_recipe("cuda", "grouped", received, 2048, 1408, experts=32,
                                           expected=lambda: ExpectedRows(16384 * 8, "sent"))
    assert recipe == "bf16" and "too small" in why  # 16B: the size rule (static rows lost there already)
    recipe, why = auto.choose_recipe("cuda", "grouped", received, 8192, 8192, experts=32,
                                           expected=lambda: ExpectedRows(16384 * 8, "sent"))
    assert recipe == "bf16" and "not measured" in why and "--received-rows" in why  # big enough, but no curve
    recipe, why = auto.choose_recipe("cuda", "grouped", received, 7168, 2048, experts=32)
    assert recipe == "bf16" and "tokens per expert unknown" in why  # no exchange upstream: as before


# every grouped GEMM on received rows in the EP catalog (blocks written apart from the pass, tests/fixtures/independent)
# expects T*K rows; where the rows sent are data dependent too (masked_select) there is nothing to expect before
# the deepep rewrite (after it, moepass::ep_dispatch's ids give T*K)
_NOTHING_TO_EXPECT = {"MegatronMaskedSelectSortChunks", "CapacityDroppingDispatch", "SenderPaddedGroups"}
# blocks whose experts are no grouped GEMM on received rows (a per-expert loop, bmm, einsum, padded static rows)
_NO_GROUPED_ON_RECEIVED_ROWS = {"SequentialMLPSplitLoop", "PaddedCapacityBmm", "DeepSpeedNoDropCapacityEinsum",
                                "TransformersAllToAllEP", "TorchAOPaddedPermute"}
_CATALOG_BLOCKS = [(c, n) for c in ("ep_catalog", "ep_catalog_unseen") for n in __import__(c).CATALOG]


@pytest.mark.parametrize("catalog, name", _CATALOG_BLOCKS, ids=[n for _, n in _CATALOG_BLOCKS])
def test_catalog_experts_expect_the_rows_each_rank_sends(catalog, name):
    from moepass.analysis.routed_rows import RoutedRows
    from moepass.analysis.scopes import graph_scopes
    from moepass.analysis.graph import example_int, tensor_meta

    block = __import__(catalog).build(name, dist.group.WORLD)
    graphs = []

    def backend(gm, _):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(block, backend=backend)(torch.randn(2, 8, 64, dtype=torch.bfloat16))
    except Exception:  # noqa: BLE001  (the fake group's collectives return garbage: only the graphs are read)
        pass
    expected = [RoutedRows(gm).expected(n.args[0]) for gm in graphs for scope in graph_scopes(gm)
                for n in scope.graph.nodes if n.target is torch._grouped_mm
                and example_int(tensor_meta(n.args[0]).shape[0]) is None]
    want = None if name in _NOTHING_TO_EXPECT else 2 * 8 * 2  # B * S * top-k
    assert bool(expected) == (name not in _NO_GROUPED_ON_RECEIVED_ROWS), (name, expected)
    assert all((e.rows if e else None) == want for e in expected), (name, expected)
