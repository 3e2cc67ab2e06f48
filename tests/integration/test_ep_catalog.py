"""The deepep pass on a catalog of independently written EP MoE blocks (tests/fixtures/independent/ep_catalog.py).

Each block is spelled as a different engineer would write it (counts by bincount, histc, one_hot, scatter_;
1-D or [ranks, E/ranks] counts; [T, K] or [B, S, K] ids; splits by .tolist(), .item(), .cpu(); funcol,
autograd funcol, in-place c10d and Megatron autograd.Function all-to-alls; combines by index_add,
scatter_add, index_put, a reshape-sum over K and a custom scatter-add op; weights before or after the
experts). Every plain block must be rewritten, with no all-to-all left and the numbers of the
uncompiled block; every non-plain one (drops slots, sends padding, averages, pads groups) must be left
alone with a reason naming what differs from DeepEP's dispatch/combine.

Runs eagerly after the rewrite (inductor=False): what is checked is the rewrite, on 2 gloo ranks.
Tolerances: outputs atol = rtol = 2e-2 and gradients within 1/32 of their largest value (bf16 rows summed
in fp32 by the rewrite, in bf16 by some originals).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_shared import rank_pool  # noqa: F401  (a fixture)

import ep_catalog
import ep_catalog_unseen

# what each non-plain block must be refused for (a substring of the skip reason)
REFUSED_FOR = {
    "CapacityDroppingDispatch": "top-k slots per expert",
    "SenderPaddedGroups": "top-k slots per expert",
    "ScatterReduceMeanCombine": "not the sum of each token's K returned rows",
    "TorchAOPaddedPermute": "not a permutation of the received rows",
}
# ep_catalog_unseen (written after the pass, to find what it missed): the blocks it leaves alone, and why
UNSEEN_REFUSED_FOR = {
    # a graph break (async_op=True + work.wait(); transformers' `if tokens.shape[0] == 0`) splits the region
    "MegablocksSearchsortedAsync": "a graph break splits the region",
    "TransformersAllToAllEP": "a graph break splits the region",
    "TransformersAllToAllEPNoEmptyBranch": "experts read the received row count",
    "PaddedCapacityBmm": "not a permutation of the received rows",
    "DeepSpeedNoDropCapacityEinsum": "capacity-padded one",  # not a DeepEP region: equal splits, no counts exchange
}
GRAPH_BREAKS = {"MegablocksSearchsortedAsync", "TransformersAllToAllEP"}


def _forward_backward(fn, block, x, rank):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))
    (out.float() * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def check_block(rank, world_size, name, dynamic=False, empty_rank=None, unseen=False):
    import moepass

    catalog, refused_for = (ep_catalog_unseen, UNSEEN_REFUSED_FOR) if unseen else (ep_catalog, REFUSED_FOR)
    block = catalog.build(name, dist.group.WORLD)
    batch = 0 if rank == empty_rank else 2
    x = torch.randn(batch, 8, 64, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)
    want = _forward_backward(block, block, x, rank)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        compiled = torch.compile(block, backend="moepass", fullgraph=name not in GRAPH_BREAKS, dynamic=dynamic,
                                 options={"passes": ["deepep"], "inductor": False})
        got = _forward_backward(compiled, block, x, rank)
    d = report.to_dict()
    (deepep,) = [p for p in d["passes"] if p["name"] == "deepep"]
    a2a_left = sum(v for k, v in d["ops_after"].items() if "all_to_all_single" in k)
    if name in refused_for:
        assert deepep["replaced"] == 0, deepep
        assert any(refused_for[name] in s["reason"] for s in deepep["skipped"]), deepep["skipped"]
        assert a2a_left >= 2  # all of them (an autograd.Function's also in its backward; a graph break's in one part)
    else:
        assert catalog.CATALOG[name][1]
        assert deepep["replaced"] == 1 and deepep["skipped"] == [], deepep
        assert a2a_left == 0 and d["ops_after"]["moepass.ep_dispatch"] == 1, d["ops_after"]
        if dynamic:  # T is a symbol: the region was checked on a few tokens, not the example's
            assert "checked at T=" in deepep["rewrites"][0]["detail"], deepep["rewrites"]
    (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) = got, want
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    assert grads.keys() == ref_grads.keys()
    for key, grad, ref in [("x", x_grad, ref_x_grad)] + [(n, grads[n], ref_grads[n]) for n in grads]:
        if ref.numel() == 0:  # an empty batch's x grad
            assert grad.numel() == 0, key
            continue
        scale = ref.abs().max().float().clamp_min(1e-6)
        assert (grad.float() - ref.float()).abs().max() <= scale / 32, key


def test_catalog_has_the_forms_the_pass_must_accept():
    plain = [n for n, (_, is_plain) in ep_catalog.CATALOG.items() if is_plain]
    assert len(plain) >= 6 and set(REFUSED_FOR) == set(ep_catalog.CATALOG) - set(plain)


@pytest.mark.parametrize("name", list(ep_catalog.CATALOG))
def test_catalog_block(name, rank_pool):
    rank_pool(2).run(check_block, name)


@pytest.mark.parametrize("name", list(ep_catalog_unseen.CATALOG))
def test_unseen_catalog_block(name, rank_pool):
    """Blocks in styles the pass was not written against (Megatron, Megablocks, a per-expert loop, DeepSpeed,
    transformers 5's own EP): every DeepEP region that reaches the pass in one graph is rewritten."""
    if name not in UNSEEN_REFUSED_FOR:
        assert ep_catalog_unseen.DEEPEP_REGION[name][0]
    rank_pool(2).run(check_block, name, False, None, True)


@pytest.mark.parametrize("name", ["OneHotTolistIndexAdd", "TorchtitanLike2DCounts", "DeepSeekWeightsBefore",
                                  "ScatterReduceMeanCombine"])
def test_catalog_block_with_dynamic_token_count(name, rank_pool):
    """dynamic=True: the token count (and every other size) is symbolic; the checks bind it to a few tokens."""
    rank_pool(2).run(check_block, name, True)


@pytest.mark.parametrize("name", ["OneHotTolistIndexAdd", "DeepSeekWeightsBefore", "TorchtitanLike2DCounts"])
def test_catalog_block_with_an_empty_batch_on_one_rank(name, rank_pool):
    """Rank 0 has no tokens: its graph is traced at T=0 and must be rewritten exactly like rank 1's, or the two
    ranks run different collectives and hang (the config sweep found this)."""
    rank_pool(2).run(check_block, name, False, 0)
