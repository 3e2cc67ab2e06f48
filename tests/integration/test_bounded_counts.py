"""EP regions whose per-expert counts come from bincount(ids, minlength=E): a length only the ids' provenance bounds.

Under Dynamo `torch.bincount(ids, minlength=E)` has an unbacked length u0 >= E. When the ids provably lie in [0, E)
(moepass.analysis.bounded_ids: top-k / argmax indices over E experts, `% E`, `.clamp(0, E - 1)`, through views,
casts and gathers), the length is E: the analysis pins it (moepass.analysis.counts_length) and the deepep rewrite
asserts in the graph that the ids do lie in [0, E). Checked here:
- the bound analysis on small graphs, one case per rule, and where it says "not proven";
- the finder on one process and a fake process group (as tests/unit/test_ep_region.py): every counts spelling
  (bincount, zeros.scatter_add_, histc) over every provably bounded id source is one region, and bincount over ids
  not provably < E is left alone with a reason naming where the ids come from;
- the rewrite on 2 gloo ranks: the rewritten block (eager) equals the uncompiled block bit for bit (outputs and
  gradients: top-2 routing, fp32 per-token sums in the same order), also with a dynamic token count and with an
  empty batch on one rank; with Inductor within the tolerances tests/integration/test_deepep_pass.py uses for compiled vs eager
  (rtol 2e-2, atol 6e-2; gradients within 1/32 of their max);
- the runtime check: the rewritten graph holds `_assert_async(all(0 <= ids < E))` on the ids the bincount counted,
  kept alive although the bincount and the counts exchange are gone, and it raises, eager and under Inductor, when
  it is fed ids >= E.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from rank_shared import rank_pool  # noqa: F401  (a fixture: ranks forked from a server that imported torch once)
from torch import nn

from moepass.dynamo_flags import FLAGS
from moepass.analysis.bounded_ids import ids_bound
from moepass.analysis.counts_length import bincount_lengths

DIM, EXPERTS, TOP_K, RANKS = 64, 8, 2, 2


@pytest.fixture(scope="module", autouse=True)
def ep_capture_flags():
    """The graphs here are captured by the tests' own backends, which moepass gives no flags: set what its frames get."""
    with torch._dynamo.config.patch(FLAGS):
        yield


def _graph(fn, *args) -> torch.fx.GraphModule:
    graphs = []
    torch._dynamo.reset()
    torch.compile(fn, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def _bound_of_output(fn, *args):
    """ids_bound of the value `fn` returns."""
    gm = _graph(fn, *args)
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    (returned,) = output.args[0]
    return ids_bound(returned)


SCORES = torch.randn(16, EXPERTS)

# ---------------------------------------------------------------- the bound analysis, one rule at a time

BOUNDED = [
    pytest.param(lambda s: s.topk(TOP_K, dim=-1).indices, EXPERTS, id="topk"),
    pytest.param(lambda s: torch.topk(s, TOP_K)[1].view(-1), EXPERTS, id="torch.topk-view"),
    pytest.param(lambda s: s.argmax(-1), EXPERTS, id="argmax"),
    pytest.param(lambda s: s.argmax(), 16 * EXPERTS, id="argmax-flat"),
    pytest.param(lambda s: s.max(-1)[1].unsqueeze(-1).to(torch.int32), EXPERTS, id="max-dim-to-int32"),
    pytest.param(lambda s: torch.sort(s, dim=0, stable=True)[1], 16, id="sort-dim0"),
    pytest.param(lambda s: s.argsort(-1)[:, :TOP_K].reshape(-1).contiguous(), EXPERTS, id="argsort-slice"),
    # group-limited routing (DeepSeek-V3): the top-k still picks among E columns
    pytest.param(lambda s: s.masked_fill(s.view(16, 4, 2).amax(-1).topk(2, -1).indices.new_zeros(16, EXPERTS)
                                         .bool(), 0.0).topk(TOP_K, -1)[1], EXPERTS, id="group-limited-topk"),
    pytest.param(lambda s: (s.topk(TOP_K, -1).indices + 3) % EXPERTS, EXPERTS, id="remainder"),
    pytest.param(lambda s: (s * 10).long().clamp(0, EXPERTS - 1), EXPERTS, id="clamp"),
    pytest.param(lambda s: (s * 10).long().clamp(min=0, max=EXPERTS - 1), EXPERTS, id="clamp-kwargs"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices.clamp(max=3), 4, id="clamp-max-of-indices"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices // 2, EXPERTS // 2, id="floordiv"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices.flatten().float().long(), EXPERTS, id="float-roundtrip"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices.view(-1)[torch.arange(4)], EXPERTS, id="getitem-gather"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices.gather(1, torch.zeros(16, 1, dtype=torch.int64)), EXPERTS,
                 id="gather"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices.index_select(0, torch.arange(3)), EXPERTS, id="index_select"),
    pytest.param(lambda s: s.topk(TOP_K, -1).indices.split(8)[1], EXPERTS, id="split-item"),
]


@pytest.mark.parametrize("fn, limit", BOUNDED)
def test_ids_bound_is_proven(fn, limit):
    bound = _bound_of_output(fn, SCORES)
    assert bound.limit == limit, bound


NOT_BOUNDED = [
    pytest.param(lambda s, ids: ids, "a graph input", id="graph-input"),
    pytest.param(lambda s, ids: s.topk(TOP_K, -1).indices + 1, "which does not bound its values", id="add"),
    pytest.param(lambda s, ids: s.topk(TOP_K, -1).values.long(), "output 0 of topk", id="topk-values"),
    pytest.param(lambda s, ids: (s * 10).long().clamp(max=EXPERTS - 1), "values not known to be >= 0",
                 id="clamp-without-min"),
    pytest.param(lambda s, ids: (s * 10).long() % ids.sum(), "a remainder by something other", id="remainder-by-data"),
    pytest.param(lambda s, ids: s.repeat(1, 40).topk(2, -1).indices.to(torch.int8), "a cast to torch.int8",
                 id="cast-too-narrow"),
    pytest.param(lambda s, ids: s.repeat(1, 40).topk(2, -1).indices.to(torch.bfloat16).long(),
                 "a cast to torch.bfloat16", id="cast-inexact"),
]


@pytest.mark.parametrize("fn, why", NOT_BOUNDED)
def test_ids_bound_is_not_proven_and_says_where_it_stopped(fn, why):
    bound = _bound_of_output(fn, SCORES, torch.randint(0, EXPERTS, (16, TOP_K)))
    assert bound.limit is None and why in bound.how, bound


def test_ids_written_in_place_are_not_bounded():
    """`ids[mask] = 99` after the top-k: later readers of ids see values the top-k did not choose."""

    def overwritten(s):
        ids = s.topk(TOP_K, -1).indices
        flat = ids.view(-1)
        flat[flat == 0] = 99  # through a view
        return ids.clone()

    bound = _bound_of_output(overwritten, SCORES)
    assert bound.limit is None and "written in place by" in bound.how, bound


# ---------------------------------------------------------------- bincount lengths


def _bincount_lengths(counts_fn):
    gm = _graph(lambda s: counts_fn(s.topk(TOP_K, -1).indices.view(-1)) * 1, SCORES)
    (mul,) = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "mul"]
    return bincount_lengths(mul, stop=set())


def test_bincount_length_is_its_minlength_when_ids_are_below_it():
    (length,) = _bincount_lengths(lambda ids: torch.bincount(ids, minlength=EXPERTS))
    assert length.length == EXPERTS and "topk indices over dim -1 of size 8" in length.why
    assert length.bincount.target is torch.bincount


@pytest.mark.parametrize("counts_fn, why", [
    pytest.param(lambda ids: torch.bincount(ids), "without a minlength", id="no-minlength"),
    pytest.param(lambda ids: torch.bincount(ids, minlength=4), "are < 8", id="minlength-below-the-bound"),
    pytest.param(lambda ids: torch.bincount(ids + 1, minlength=EXPERTS), "not provably < 8", id="ids-not-bounded"),
])
def test_bincount_length_is_not_proven(counts_fn, why):
    (length,) = _bincount_lengths(counts_fn)
    assert length.length is None and why in length.why, length


def test_static_counts_carry_no_bincount_length():
    assert _bincount_lengths(lambda ids: torch.zeros(EXPERTS, dtype=torch.int64).scatter_add(
        0, ids, torch.ones_like(ids))) == []


# ---------------------------------------------------------------- an EP block, written apart from the pass


class BoundedCountsMoE(nn.Module):
    """A plain EP MoE on x [B, S, D]: softmax router, expert ids from `ids_from`, per-expert counts from
    `counts_from`, split sizes by .tolist(), funcol all-to-alls, an expert-major argsort over per-expert ids
    rebuilt on the receiver, grouped-GEMM experts, index_copy un-permute, fp32 index_add combine.

    ids_from: "topk", "group_limited" (DeepSeek-V3 group-limited top-k), "argmax" (top-1), "shifted_remainder"
    ((topk + shift) % E: a rotated expert placement), "clamped_hash" (consecutive experts from a hashed base,
    clamped to [0, E - 1]), "shifted" ((topk + shift) with no remainder: not provably < E).
    counts_from: "bincount", "bincount_no_minlength", "scatter_add", "histc".
    """

    def __init__(self, group, ids_from="topk", counts_from="bincount", experts=EXPERTS, dim=DIM):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.group, self.ranks, self.experts = group, group.size(), experts
        self.local = experts // self.ranks
        self.ids_from, self.counts_from = ids_from, counts_from
        self.top_k = 1 if ids_from == "argmax" else TOP_K
        self.gate = nn.Parameter((torch.randn(experts, dim, generator=gen) * dim**-0.5).bfloat16())
        self.w1 = nn.Parameter((torch.randn(self.local, dim, dim // 2, generator=gen) * dim**-0.5).bfloat16())
        self.w2 = nn.Parameter((torch.randn(self.local, dim // 2, dim, generator=gen) * dim**-0.5).bfloat16())
        self.shift = 0  # an int attribute Dynamo reads as a constant

    def route(self, h):
        scores = F.linear(h, self.gate).float().softmax(-1)
        e, k = self.experts, self.top_k
        if self.ids_from == "topk":
            ids = scores.topk(k, dim=-1).indices
        elif self.ids_from == "group_limited":  # 4 groups, keep the best 2 (by their top-2 sum)
            group_scores = scores.view(-1, 4, e // 4).topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(2, dim=-1).indices, 1.0)
            masked = scores.masked_fill(keep.repeat_interleave(e // 4, dim=1) == 0, 0.0)
            ids = masked.topk(k, dim=-1).indices
        elif self.ids_from == "argmax":
            ids = scores.argmax(-1, keepdim=True)
        elif self.ids_from == "shifted_remainder":
            ids = (scores.topk(k, dim=-1).indices + self.shift) % e
        elif self.ids_from == "clamped_hash":
            base = (h.float().sum(-1).abs() * 1000).long() % (e - k + 1)
            ids = (base.unsqueeze(-1) + torch.arange(k)).clamp(0, e - 1)
        elif self.ids_from == "shifted":
            ids = scores.topk(k, dim=-1).indices + self.shift
        return ids, scores.gather(-1, ids)

    def counts(self, flat):
        if self.counts_from == "bincount":
            return torch.bincount(flat, minlength=self.experts)
        if self.counts_from == "bincount_no_minlength":
            return torch.bincount(flat)
        if self.counts_from == "scatter_add":
            return torch.zeros(self.experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        if self.counts_from == "histc":  # CPU histc takes floats
            return torch.histc(flat.float(), self.experts, 0, self.experts - 1).long()
        raise ValueError(self.counts_from)

    def forward(self, x):
        return self.exchange(x, *self.route(x.flatten(0, 1)))

    def exchange(self, x, ids, weights):
        h = x.flatten(0, 1)
        flat = ids.view(-1)
        counts = self.counts(flat)
        order = torch.argsort(flat, stable=True)
        received_counts = funcol.all_to_all_single(counts, None, None, self.group)
        input_splits = counts.view(self.ranks, -1).sum(1).tolist()
        output_splits = received_counts.view(self.ranks, -1).sum(1).tolist()
        received = funcol.all_to_all_single_autograd(h[order // self.top_k], output_splits, input_splits, self.group)
        # per-row local expert ids, rebuilt from the received counts (rank-major: [rank][local expert])
        expert_of_row = (torch.arange(received_counts.shape[0]) % self.local).repeat_interleave(
            received_counts, output_size=received.shape[0])
        perm = torch.argsort(expert_of_row, stable=True)
        offsets = received_counts.view(self.ranks, -1).sum(0).cumsum(0).to(torch.int32)
        hidden = F.silu(torch._grouped_mm(received[perm], self.w1, offs=offsets))
        y = torch._grouped_mm(hidden, self.w2, offs=offsets)
        back = torch.zeros_like(y).index_copy(0, perm, y)
        returned = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        rows = returned.float() * weights.view(-1)[order].unsqueeze(-1)
        out = torch.zeros(h.shape, dtype=torch.float32).index_add(0, order // self.top_k, rows)
        return out.to(x.dtype).view_as(x)


def _x(rank=0, batch=2):
    return torch.randn(batch, 8, DIM, generator=torch.Generator().manual_seed(100 + rank)).bfloat16()


# every provably bounded id source, with every counts spelling where it matters (bincount's length)
REWRITTEN = [("topk", "bincount"), ("group_limited", "bincount"), ("argmax", "bincount"),
             ("shifted_remainder", "bincount"), ("clamped_hash", "bincount"), ("topk", "scatter_add"),
             ("topk", "histc")]
LEFT_ALONE = {  # (ids_from, counts_from) -> what the reason says
    ("shifted", "bincount"): "its ids are not provably < 8 (they come from ids (add, which does not bound its values))",
    ("topk", "bincount_no_minlength"): "bincount without a minlength has max(ids) + 1 entries",
}


# ---------------------------------------------------------------- the finder, one process on a fake group


@pytest.fixture
def fake_process_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=RANKS)
    yield dist.group.WORLD
    dist.destroy_process_group()


class _Captured(Exception):
    """Raised instead of running the captured graph (the fake group's collectives return garbage)."""


def _capture(block, *args):
    """(graph, example inputs) of the block as Dynamo hands them to a backend."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, example_inputs))

        def never_run(*args):
            raise _Captured

        return never_run

    torch._dynamo.reset()
    with pytest.raises(_Captured):
        torch.compile(block, backend=backend, fullgraph=True)(*args)
    (found,) = captured
    return found


@pytest.mark.parametrize("ids_from, counts_from", REWRITTEN, ids=["-".join(c) for c in REWRITTEN])
def test_region_is_found(ids_from, counts_from, fake_process_group):
    from moepass.analysis.ep_region import find_ep_regions

    gm, _ = _capture(BoundedCountsMoE(fake_process_group, ids_from, counts_from), _x())
    regions, skips = find_ep_regions(gm)
    assert skips == []
    (region,) = regions
    assert (region.num_experts, region.top_k, region.weights_applied) == \
        (EXPERTS, 1 if ids_from == "argmax" else TOP_K, "after_experts")
    assert region.checked_routings >= 3
    if counts_from == "bincount":  # its length was proven E from the ids, and is now E in the shape env
        (pinned,) = region.pinned_lengths
        assert pinned.bincount.target is torch.bincount and pinned.length == EXPERTS
        assert tuple(pinned.bincount.meta["example_value"].shape) == (EXPERTS,)
    else:  # histc and scatter_add have a static length: nothing to prove
        assert region.pinned_lengths == []


@pytest.mark.parametrize("spelling, reason", LEFT_ALONE.items(), ids=["-".join(c) for c in LEFT_ALONE])
def test_region_with_unproven_bincount_length_is_left_alone_with_the_reason(spelling, reason, fake_process_group):
    from moepass.analysis.ep_region import find_ep_regions
    from moepass.report.left_alone import explain
    from moepass.skips import SkipCode

    gm, _ = _capture(BoundedCountsMoE(fake_process_group, *spelling), _x())
    regions, skips = find_ep_regions(gm)
    assert regions == []
    (skip,) = skips
    assert skip.reason.startswith("counts all-to-all does not send a static integer count per expert (sends "
                                  "int64[u0], bincount `counts`): bincount's length is data dependent and ")
    assert reason in skip.reason, skip.reason
    assert "all_to_all_single" in str(skip.node.target)  # anchored on the counts exchange
    assert explain(skip) is SkipCode.BINCOUNT_LENGTH and SkipCode.BINCOUNT_LENGTH.phrase in skip.reason
    (bincount,) = [n for n in gm.graph.nodes if n.target is torch.bincount]
    assert _length_is_unbacked(bincount)  # nothing was pinned


def _length_is_unbacked(node) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return bool(free_unbacked_symbols(node.meta["example_value"].shape[0]))


def test_ids_from_a_graph_input_are_not_provably_bounded(fake_process_group):
    """The router outside the compiled region: the ids come in as an input, and nothing bounds them."""
    from moepass.analysis.ep_region import find_ep_regions

    block = BoundedCountsMoE(fake_process_group)
    ids = torch.randint(0, EXPERTS, (16, TOP_K))
    gm, _ = _capture(block.exchange, _x(), ids, torch.rand(16, TOP_K))
    regions, skips = find_ep_regions(gm)
    assert regions == []
    (skip,) = skips
    assert "its ids are not provably < 8 (they come from l_ids_ (a graph input))" in skip.reason, skip.reason


def _rewrite(gm):
    from moepass.options import Config
    from moepass.passes import deepep
    from moepass.report.records import PassRecord

    record = PassRecord("deepep")
    deepep.run(gm, Config.from_options({}), record)
    return record


def _ids_checks(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten._assert_async.msg
            and "moepass deepep" in str(n.args[1])]


def _checked_ids(check: torch.fx.Node) -> torch.fx.Node:
    """The ids the check reads: all(logical_and(ids >= 0, ids < E))."""
    (in_range,) = check.args[0].args
    ge, lt = in_range.args
    assert (ge.target, ge.args[1], lt.target, lt.args[1]) == \
        (torch.ops.aten.ge.Scalar, 0, torch.ops.aten.lt.Scalar, EXPERTS) and ge.args[0] is lt.args[0]
    return ge.args[0]


def test_rewritten_graph_asserts_the_ids_lie_below_the_experts(fake_process_group):
    gm, _ = _capture(BoundedCountsMoE(fake_process_group), _x())
    (bincount,) = [n for n in gm.graph.nodes if n.target is torch.bincount]
    counted = bincount.args[0]
    record = _rewrite(gm)
    (rewrite,) = record.rewrites
    assert "bincount `counts` has 8 entries (its ids are < 8: topk indices over dim -1 of size 8" in rewrite.detail
    assert "asserted at run time" in rewrite.detail
    assert not [n for n in gm.graph.nodes if "all_to_all_single" in str(n.target)]
    (check,) = _ids_checks(gm)
    assert _checked_ids(check) is counted
    # the bincount itself was read only by the exchange: it is gone, the check of its ids stays
    assert not [n for n in gm.graph.nodes if n.target is torch.bincount]


def _feed_ids_past_the_experts(gm):
    """The checked code path with ids it was not meant to see: the check reads ids + E."""
    from moepass.analysis.emit import fake_value

    (check,) = _ids_checks(gm)
    ids = _checked_ids(check)
    with gm.graph.inserting_after(ids):
        shifted = gm.graph.call_function(torch.ops.aten.add.Scalar, (ids, EXPERTS))
    fake_value(shifted, ids.meta["example_value"].fake_mode)
    for reader in (check.args[0].args[0].args):  # ids >= 0, ids < E
        reader.replace_input_with(ids, shifted)
    gm.recompile()


IDS_CHECK_FIRED = r"moepass deepep: the ids counted by bincount `counts` must lie in \[0, 8\)"


def test_ids_check_fires_in_eager_when_ids_reach_past_the_experts(fake_process_group):
    gm, example_inputs = _capture(BoundedCountsMoE(fake_process_group), _x())
    _rewrite(gm)
    _feed_ids_past_the_experts(gm)
    with pytest.raises(RuntimeError, match=IDS_CHECK_FIRED):
        gm(*example_inputs)  # it raises before the first collective


# ---------------------------------------------------------------- the rewrite, on 2 gloo ranks


def _run(block, x, options=None, dynamic=None):
    """(output, grads of the parameters and of x, report) of one forward + backward."""
    import moepass

    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    with moepass.collecting() as report:
        compiled = torch.compile(block, backend="moepass", options=options, fullgraph=True, dynamic=dynamic)
        out = compiled(x) if options else block(x)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        (out.float() * g.float()).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    grads["<input>"] = x.grad.clone()
    return out.detach(), grads, report.to_dict()


def _deepep(report) -> dict:
    (deepep,) = [p for p in report["passes"] if p["name"] == "deepep"]
    return deepep


def _all_to_alls_left(report) -> int:
    return sum(v for k, v in report["ops_after"].items() if "all_to_all_single" in k)


def check_block_rewritten(rank, world_size, ids_from, counts_from, dynamic=None, empty_rank=None):
    block = BoundedCountsMoE(dist.group.WORLD, ids_from, counts_from)
    x = _x(rank, batch=0 if rank == empty_rank else 2)
    want = _run(block, x)
    got = _run(block, x, {"passes": ["deepep"], "inductor": False}, dynamic)
    deepep = _deepep(got[2])
    assert deepep["replaced"] == 1 and deepep["skipped"] == [], deepep
    if dynamic:  # T is a symbol: the region was checked on a few tokens; the bincount's length is still E
        assert "checked at T=" in deepep["rewrites"][0]["detail"]
    assert _all_to_alls_left(got[2]) == 0 and got[2]["ops_after"]["moepass.ep_dispatch"] == 1
    assert ("asserted at run time" in deepep["rewrites"][0]["detail"]) == (counts_from == "bincount")
    (out, grads, _), (ref_out, ref_grads, _) = got, want
    assert torch.equal(out, ref_out), f"outputs differ by {(out.float() - ref_out.float()).abs().max()}"
    assert grads.keys() == ref_grads.keys()
    assert not [n for n in grads if not torch.equal(grads[n], ref_grads[n])]


@pytest.mark.parametrize("ids_from, counts_from", REWRITTEN, ids=["-".join(c) for c in REWRITTEN])
def test_block_rewritten_matches_uncompiled_bitwise(ids_from, counts_from, rank_pool):
    rank_pool(2).run(check_block_rewritten, ids_from, counts_from)


def test_block_with_a_dynamic_token_count_is_rewritten(rank_pool):
    """dynamic=True: T is symbolic, the top-k is still over a static E columns."""
    rank_pool(2).run(check_block_rewritten, "topk", "bincount", True)


def test_block_with_an_empty_batch_on_one_rank_is_rewritten_like_the_other(rank_pool):
    """Rank 0 has no tokens (traced at T=0): it must prove and rewrite exactly as rank 1, or the ranks hang."""
    rank_pool(2).run(check_block_rewritten, "topk", "bincount", None, 0)


def check_block_left_alone(rank, world_size, ids_from, counts_from, reason):
    block = BoundedCountsMoE(dist.group.WORLD, ids_from, counts_from)
    want = _run(block, _x(rank))
    got = _run(block, _x(rank), {"passes": ["deepep"], "inductor": False})
    deepep = _deepep(got[2])
    assert deepep["replaced"] == 0 and _all_to_alls_left(got[2]) == 3
    assert [reason in s["reason"] for s in deepep["skipped"]] == [True], deepep["skipped"]
    assert torch.equal(got[0], want[0])


def test_block_with_unproven_ids_is_left_alone_and_still_runs(rank_pool):
    rank_pool(2).run(check_block_left_alone, "shifted", "bincount", LEFT_ALONE[("shifted", "bincount")])


def check_inductor(rank, world_size):
    """Compiled by Inductor: the rewritten block matches the uncompiled one; with ids past the experts fed to the
    check, the compiled code raises."""
    import moepass.passes.deepep as deepep_pass

    block = BoundedCountsMoE(dist.group.WORLD)
    want = _run(block, _x(rank))
    got = _run(block, _x(rank), {"passes": ["deepep"]})
    assert _deepep(got[2])["replaced"] == 1 and _all_to_alls_left(got[2]) == 0
    (out, grads, _), (ref_out, ref_grads, _) = got, want
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=6e-2)
    for name, grad in grads.items():
        assert (grad.float() - ref_grads[name].float()).abs().max() <= ref_grads[name].abs().max().float() / 32, name

    original_run = deepep_pass.run

    def run_then_tamper(gm, *args):
        original_run(gm, *args)
        _feed_ids_past_the_experts(gm)

    deepep_pass.run = run_then_tamper
    try:
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="moepass", options={"passes": ["deepep"]}, fullgraph=True)
        with pytest.raises(RuntimeError, match=IDS_CHECK_FIRED), torch.no_grad():  # the forward is enough
            compiled(_x(rank))
    finally:
        deepep_pass.run = original_run


def test_block_rewritten_compiles_with_inductor_and_its_check_fires(rank_pool):
    rank_pool(2).run(check_inductor, timeout_s=580)
