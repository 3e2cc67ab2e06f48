"""The deep_ep double (tests/fixtures/doubles/deep_ep) against DeepEP V1's stated semantics, written out by hand here.

The double stands in for `deep_ep` wherever moepass's DeepEP code runs in CI, so what it claims is checked apart from
moepass: handles built by hand for a small routing (intranode), the layouts' relations at 16 ranks as 2 nodes of 8
(internode, in one process), the two-level rounding of an internode combine, and Buffer itself on gloo ranks
(dispatch with and without a handle, combine with weights, the FP8 tuple, the in-place head rewrite, its refusals).
The comparison script for the first 2-GPU run (examples/compare_deepep_double.py) runs here double against double.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from doubles import deep_ep_double
from helpers import load_example, rank_pool  # noqa: F401  (rank_pool: a fixture)

with deep_ep_double():
    from deep_ep import layout  # the module object outlives the block; it imports nothing of moepass

BIG = -(1 << 25) - 1  # an unsent token before the end of its channel, after a combine (DeepEP's sentinel head)

# Two ranks, 2 channels (num_sms=4): rank 0 has 5 tokens (channels [0, 3), [3, 5)), rank 1 has 4 ([0, 2), [2, 4)).
MASKS = [torch.tensor([[1, 0], [1, 1], [0, 1], [0, 0], [1, 1]], dtype=torch.bool),
         torch.tensor([[0, 1], [1, 0], [1, 1], [0, 1]], dtype=torch.bool)]
# What DeepEP's intranode kernels write for that routing, worked out by hand from intranode.cu (see layout.py).
INTRANODE_HANDLES = {
    0: dict(rank_prefix_matrix=[[3, 3], [5, 6]], channel_prefix_matrix=[[2, 3], [2, 3]],
            recv_channel_prefix_matrix=[[0, 2], [0, 1]], recv_src_idx=[0, 1, 4, 1, 2],
            send_head=[[0, -1], [1, 0], [-1, 1], [-1, -1], [0, 0]],
            send_head_after_combine=[[0, -1], [1, 0], [BIG, 1], [-1, -1], [0, 0]]),
    1: dict(rank_prefix_matrix=[[3, 3], [5, 6]], channel_prefix_matrix=[[1, 2], [1, 3]],
            recv_channel_prefix_matrix=[[0, 2], [0, 1]], recv_src_idx=[1, 2, 4, 0, 2, 3],
            send_head=[[-1, 0], [0, -1], [0, 0], [-1, 1]],
            send_head_after_combine=[[-1, 0], [0, BIG], [0, 0], [BIG, 1]]),
}
FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
          "is_token_in_rank", "send_head")


def _topk_for(mask: torch.Tensor) -> torch.Tensor:
    """Top-2 ids over 2 experts (one a rank) that route like `mask`."""
    ids = torch.tensor([[0, 1]]).expand(mask.shape[0], 2)
    return torch.where(mask, ids, -1).contiguous()


# ---------------------------------------------------------------- layouts, one process


@pytest.mark.parametrize("rank", [0, 1])
def test_intranode_handle_is_what_deepeps_kernels_write(rank):
    handle = layout.intranode_handle(MASKS, rank, num_channels=2)
    want = INTRANODE_HANDLES[rank]
    got = dict(zip(FIELDS, handle))
    for name in FIELDS[:4] + ("send_head",):
        assert got[name].dtype == torch.int32 and got[name].tolist() == want[name], name
    assert torch.equal(got["is_token_in_rank"], MASKS[rank])
    layout.rewrite_send_head_for_combine(got["send_head"], num_channels=2)
    assert got["send_head"].tolist() == want["send_head_after_combine"]
    layout.rewrite_send_head_for_combine(got["send_head"], num_channels=2)  # idempotent: every combine runs it
    assert got["send_head"].tolist() == want["send_head_after_combine"]


def _routing(num_ranks: int, num_experts: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    masks = []
    for r in range(num_ranks):
        num_tokens = 5 + (r * 7) % 6  # ranks send different token counts
        topk_idx = torch.rand(num_tokens, num_experts, generator=gen).topk(4).indices
        topk_idx[0] = -1  # routed nowhere
        topk_idx[1, 1:] = -1
        masks.append(layout.dispatch_layout(topk_idx, num_experts, num_ranks)[3])
    return masks


def _ends(num_tokens: int, channels: int) -> list[tuple[int, int]]:
    per = -(-num_tokens // channels)
    return [(min(per * c, num_tokens), min(per * c + per, num_tokens)) for c in range(channels)]


def test_internode_handles_of_16_ranks_as_2_nodes_of_8_hold_what_deepep_states():
    """internode.cu's definitions (see layout.internode_handle), checked by brute force for every rank's view."""
    world, channels = 16, 3
    masks = _routing(world, 32, seed=3)
    handles = [layout.internode_handle(masks, r, channels) for r in range(world)]
    for me, h in enumerate(handles):
        node, gpu = divmod(me, 8)
        rows = [(s, t) for s in range(world) for t in range(masks[s].shape[0]) if masks[s][t, me]]
        assert [int(v) for v in h[6]] == [sum(1 for s, _ in rows if s <= src) for src in range(world)]
        meta = h[7].view(torch.int32).tolist()  # SourceMeta {src_rdma_rank, is_token_in_nvl_rank_bits}
        assert h[7].shape == (len(rows), 8) and h[7].dtype == torch.uint8
        assert meta == [[s // 8, sum(int(masks[s][t, node * 8 + i]) << i for i in range(8))] for s, t in rows]
        own = masks[me]
        for c, (start, end) in enumerate(_ends(own.shape[0], channels)):
            for d in range(world):
                assert h[2][d, c] == int(own[:end, d].sum())
            for n in range(2):
                assert h[1][n, c] == int(own[:end, n * 8:n * 8 + 8].any(1).sum())
                for t in range(start, end):
                    to_node = bool(own[t, n * 8:n * 8 + 8].any())
                    before = int(own[start:t, n * 8:n * 8 + 8].any(1).sum())
                    assert h[8][t, n] == (before if to_node else -1)
        peers = [n * 8 + gpu for n in range(2)]  # this GPU index on each node: the RDMA hop
        to_me = [int(masks[p][:, node * 8:node * 8 + 8].any(1).sum()) for p in peers]
        assert h[4].tolist() == [to_me[0], to_me[0] + to_me[1]]
        assert [h[3][n].tolist() for n in range(2)] == [handles[p][1][node].tolist() for p in peers]
        for s in range(world):
            for c, (start, _) in enumerate(_ends(masks[s].shape[0], channels)):
                assert h[5][s, c] == sum(1 for q, _ in rows if q < s) + int(masks[s][:start, me].sum())
        # send_nvl_head: one row per token arriving over RDMA (by source node, then token), -1 where not forwarded to
        # that local rank; DeepEP numbers the others in arrival order, a queue place each: a permutation per channel
        arriving = [(p, t) for p in peers for t in range(masks[p].shape[0]) if masks[p][t, node * 8:node * 8 + 8].any()]
        assert h[9].shape == (len(arriving), 8) and h[9].dtype == torch.int32
        for k, (p, t) in enumerate(arriving):
            for i in range(8):
                assert (h[9][k, i] >= 0) == bool(masks[p][t, node * 8 + i])
        for c in range(channels):
            in_channel = [k for k, (p, t) in enumerate(arriving)
                          if _ends(masks[p].shape[0], channels)[c][0] <= t < _ends(masks[p].shape[0], channels)[c][1]]
            for i in range(8):
                places = sorted(int(h[9][k, i]) for k in in_channel if h[9][k, i] >= 0)
                assert places == list(range(len(places)))


def test_internode_combine_rounds_each_nodes_partial_sum_to_bf16():
    """A token sent to ranks 0 and 1 (node 0) and 8 (node 1): 1 + 2^-8 rounds to 1 (ties to even) on node 0 before
    node 1's 2^-8 is added; one fp32 sum, as within a node, would give 1 + 2^-7."""
    world = 16
    is_token_in_rank = torch.zeros(1, world, dtype=torch.bool)
    is_token_in_rank[0, [0, 1, 8]] = True
    rows = torch.tensor([[1.0], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)  # back from ranks 0, 1, 8
    assert layout.combine_rows(rows, is_token_in_rank, internode=True).to(torch.bfloat16).item() == 1.0
    assert layout.combine_rows(rows, is_token_in_rank, internode=False).to(torch.bfloat16).item() == 1 + 2.0**-7
    weights = torch.tensor([[0.5], [2.0**-20], [0.25]])  # fp32 top-k weights are never rounded in between
    assert layout.combine_rows(weights, is_token_in_rank, internode=True).item() == 0.75 + 2.0**-20


def test_dispatch_layout_counts_tokens_per_rank_node_and_expert():
    topk_idx = torch.tensor([[0, 17, -1], [1, 3, 2], [-1, -1, -1], [31, 30, 16]])
    per_rank, per_rdma, per_expert, is_token_in_rank = layout.dispatch_layout(topk_idx, 32, 16)
    owners = [{0, 8}, {0, 1}, set(), {15, 8}]  # 2 experts a rank
    assert is_token_in_rank.tolist() == [[r in o for r in range(16)] for o in owners]
    assert per_rank.dtype == per_rdma.dtype == per_expert.dtype == torch.int32
    assert per_rank.tolist() == [sum(r in o for o in owners) for r in range(16)]
    assert per_rdma.tolist() == [2, 2]  # tokens 0, 1 reach node 0; tokens 0, 3 node 1
    assert per_expert.tolist() == [1 if e in (0, 17, 1, 3, 2, 31, 30, 16) else 0 for e in range(32)]
    assert layout.dispatch_layout(topk_idx[:, :1], 8, 2)[1] is None  # within a node: no per-node counts


def test_size_hints_are_deepeps_formulas():
    """config.hpp L52-107 at 2 and 16 ranks, computed here term by term."""
    with deep_ep_double() as deep_ep:
        _check_size_hints(deep_ep.Buffer)
    with deep_ep_double(nvshmem=False) as deep_ep, pytest.raises(RuntimeError, match="NVSHMEM is disable"):
        deep_ep.Buffer.get_dispatch_config(2).get_rdma_buffer_size_hint(512, 2)  # even within a node


def _check_size_hints(Buffer):
    nvl = Buffer.get_dispatch_config(2)  # Config(20, 24, 256, 6, 128): 10 channels
    rows = 10 * 2 * 256
    want = 10 * 2 * 5 * 4 + rows * (512 + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    assert nvl.get_nvl_buffer_size_hint(512, 2) == (want + 127) // 128 * 128
    assert nvl.get_rdma_buffer_size_hint(512, 2) == 0  # within a node
    wide = Buffer.get_dispatch_config(16)  # Config(20, 36, 288, 20, 128 -> 140)
    rdma_rows = 10 * 2 * 140
    want = 10 * 2 * 18 * 2 * 4 + rdma_rows * 2 * (512 + 8 + 1024 + 512 + 512 + 16)
    assert wide.get_rdma_buffer_size_hint(512, 16) == (want + 127) // 128 * 128
    with pytest.raises(AssertionError, match="Unsupported number of EP ranks: 12"):
        Buffer.get_dispatch_config(12)


# ---------------------------------------------------------------- Buffer on gloo ranks


def _buffer(deep_ep, hidden: int):
    world = dist.get_world_size()
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    nvl = max(c.get_nvl_buffer_size_hint(hidden * 2, world) for c in configs)
    return deep_ep.Buffer(dist.group.WORLD, nvl, 0, explicitly_destroy=True)


def check_buffer_intranode(rank, world_size):
    with deep_ep_double(num_sms=4) as deep_ep:
        hidden = 256
        xs = [torch.arange(m.shape[0] * hidden).reshape(-1, hidden).add(1000 * s).to(torch.bfloat16)
              for s, m in enumerate(MASKS)]
        weights = [torch.rand(m.shape[0], 2, generator=torch.Generator().manual_seed(s)) for s, m in enumerate(MASKS)]
        buffer = _buffer(deep_ep, hidden)
        topk_idx = _topk_for(MASKS[rank])
        per_rank, per_rdma, per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2)
        assert per_rdma is None and torch.equal(is_token_in_rank, MASKS[rank])
        recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            xs[rank], num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=is_token_in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
            topk_weights=weights[rank], expert_alignment=2)
        want = INTRANODE_HANDLES[rank]
        assert isinstance(handle, tuple) and len(handle) == 6
        for name, tensor in zip(FIELDS, handle):
            if name != "is_token_in_rank":
                assert tensor.tolist() == want[name], name
        rows = [(s, t) for s in range(2) for t in range(MASKS[s].shape[0]) if MASKS[s][t, rank]]
        assert torch.equal(recv_x, torch.stack([xs[s][t] for s, t in rows]))
        # one expert a rank: slot k keeps local id 0 where its expert k is this rank's, else -1
        assert recv_idx.tolist() == [[0 if MASKS[s][t, k] and k == rank else -1 for k in range(2)] for s, t in rows]
        assert recv_w.tolist() == [[float(weights[s][t, k]) if recv_idx[i, k] >= 0 else 0.0 for k in range(2)]
                                   for i, (s, t) in enumerate(rows)]
        assert counts == [(len(rows) + 1) // 2 * 2]  # one local expert, aligned up to expert_alignment=2
        again, *rest = buffer.dispatch(xs[rank] * 2, handle=handle)  # cached: the same rows, nothing else
        assert torch.equal(again, recv_x * 2) and rest[:4] == [None, None, None, None]
        y = recv_x.float().mul(rank + 1).to(torch.bfloat16)
        out, out_w, _ = buffer.combine(y, handle, topk_weights=recv_w)
        assert handle[5].tolist() == want["send_head_after_combine"]  # rewritten in place
        dests = [[d for d in range(2) if MASKS[rank][t, d]] for t in range(MASKS[rank].shape[0])]
        assert torch.equal(out, torch.stack([(xs[rank][t].float() * sum(d + 1 for d in ds)).to(torch.bfloat16)
                                             for t, ds in enumerate(dests)]))
        assert torch.equal(out_w, torch.where(topk_idx >= 0, weights[rank], 0.0))  # each weight came from its owner
        buffer.destroy()


def test_buffer_dispatch_cached_dispatch_and_combine_with_weights(rank_pool):
    rank_pool(2).run(check_buffer_intranode)


def check_buffer_fp8_tuple_and_refusals(rank, world_size):
    with deep_ep_double() as deep_ep:
        hidden = 256
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(MASKS[rank].shape[0], hidden, generator=gen)
        q = x.to(torch.float8_e4m3fn)
        scales = torch.rand(x.shape[0], hidden // 128, generator=gen)
        buffer = _buffer(deep_ep, hidden)
        topk_idx = _topk_for(MASKS[rank])
        layout_ = buffer.get_dispatch_layout(topk_idx, 2)[:4]
        args = dict(zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                         "is_token_in_rank"), (layout_[0], layout_[1], layout_[2], layout_[3])))
        (recv_q, recv_scales), *_, handle, _ = buffer.dispatch(
            (q, scales), topk_idx=topk_idx, topk_weights=torch.ones(topk_idx.shape), **args)
        objects = [None, None]
        dist.all_gather_object(objects, (q.view(torch.uint8), scales))
        rows = [(s, t) for s in range(2) for t in range(MASKS[s].shape[0]) if MASKS[s][t, rank]]
        assert recv_q.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
        assert torch.equal(recv_q.view(torch.uint8), torch.stack([objects[s][0][t] for s, t in rows]))
        assert torch.equal(recv_scales, torch.stack([objects[s][1][t] for s, t in rows]))
        cached_q, cached_scales = buffer.dispatch((q, scales), handle=handle)[0]
        assert torch.equal(cached_q.view(torch.uint8), recv_q.view(torch.uint8)) and torch.equal(cached_scales,
                                                                                                 recv_scales)
        # what DeepEP documents or refuses
        with pytest.raises(TypeError, match="hidden // 128"):
            buffer.dispatch((q, scales[:, :1].contiguous()), handle=handle)
        with pytest.raises(TypeError, match="bfloat16"):
            buffer.dispatch(x, handle=handle)
        with pytest.raises(AssertionError):
            buffer.dispatch(x.to(torch.bfloat16), handle=handle, topk_idx=topk_idx)
        with pytest.raises(deep_ep.DeepEPDeviceTrap, match="8192"):
            buffer.dispatch(torch.zeros(3, 8192, dtype=torch.bfloat16), handle=handle)
        with pytest.raises(deep_ep.DeepEPHostAssert, match="num_ranks > NUM_MAX_NVL_PEERS"):
            deep_ep.Buffer(dist.group.WORLD, 1 << 20, 1 << 20, explicitly_destroy=True)
        small = deep_ep.Buffer(dist.group.WORLD, 128, 0, explicitly_destroy=True)
        with pytest.raises(deep_ep.DeepEPHostAssert, match="num_nvl_bytes"):
            small.dispatch(x.to(torch.bfloat16), handle=handle)
        small.destroy()
        buffer.destroy()
        with pytest.raises(AssertionError, match="destroyed"):
            buffer.get_dispatch_layout(topk_idx, 2)


def test_buffer_fp8_tuple_and_what_it_refuses(rank_pool):
    rank_pool(2).run(check_buffer_fp8_tuple_and_refusals)


# ---------------------------------------------------------------- the comparison script for the first 2-GPU run


def check_compare_script_double_against_double(rank, world_size, out_dir):
    compare = load_example("compare_deepep_double")
    with deep_ep_double() as deep_ep:
        rows = compare.compare(deep_ep, deep_ep, dist.group.WORLD, torch.device("cpu"), hidden=256, num_tokens=24,
                               num_experts=8, num_topk=3, seed=5)
    assert rows and all(row["agree"] for row in rows), [r for r in rows if not r["agree"]]
    names = {row["output"] for row in rows}
    assert {"dispatch.recv_x", "dispatch.handle.send_head", "cached_dispatch.recv_x", "combine.x",
            "combine.topk_weights", "fp8_dispatch.recv_x_scales", "combine.handle.send_head"} <= names, names
    if rank == 0:
        path = compare.write_json(rows, out_dir, command="test", implementations=("double", "double"))
        record = json.loads(open(path).read())
        assert record["all_agree"] and record["torch"] == torch.__version__ and "commit" in record


def test_compare_script_runs_double_against_double(rank_pool, tmp_path):
    rank_pool(2).run(check_compare_script_double_against_double, str(tmp_path))
