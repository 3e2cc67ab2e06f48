"""The deepep pass on EP blocks whose per-expert counts come from bincount (tests/fixtures/independent/ep_catalog_bounded.py).

bincount(ids, minlength=E) has a length Dynamo only bounds (an unbacked u0 >= E). The blocks are written apart
from the pass, after torchtitan, Megatron-LM, Llama 4 and DeepSeek-V3; with them two static-length controls and
one negative (capacity dropping: not a DeepEP region, never to be rewritten). On 2 gloo ranks each block compiled
with torch.compile(block, backend="moepass", options={"passes": ["deepep"], ...}, fullgraph=True) must match
`reference(block, x)` and the uncompiled block's gradients, whatever the pass did. Whether the pass rewrites it,
or which reason it leaves it alone with, is EXPECT_REWRITTEN: today's outcome, to flip as the pass learns. The
catalog's COUNTS_LENGTH claim (bounded / pinned / static) is checked on the traced graph.

Runs eagerly after the rewrite (inductor=False, as tests/integration/test_ep_catalog.py: what is checked is the rewrite),
except test_plain_block_through_inductor. Tolerances as test_ep_catalog.py: outputs atol = rtol = 2e-2,
gradients within 1/32 of their largest value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rank_shared import rank_pool  # noqa: F401  (a fixture)

import ep_catalog_bounded
from moepass.dynamo_flags import FLAGS

# Today's outcome of the deepep pass per block, for the lead to flip as the pass learns: True = the region is
# replaced by moepass::ep_dispatch/ep_combine; a string = left alone, with that substring in the skip reason.
# (At commit cf4432e every "bounded" block was left alone with "counts all-to-all does not send a static integer
# count per expert (sends int64[u0])", [2, (u0//2)] for torchtitan's; the pinned and static ones were rewritten.)
EXPECT_REWRITTEN: dict[str, bool | str] = {
    "BincountTolistIndexAdd": True,
    "TorchtitanDispatcherBincount": True,
    "MegatronDispatcherBincount": True,
    "Llama4ScoresBeforeBincount": True,
    "DeepSeekV3GroupLimitedBincount": True,
    "FlatBSKViewBincount": True,
    "ReceiverBincountOffsets": True,
    "ScatterAddCountsControl": True,
    "HistcCountsControl": True,
    # not a DeepEP region (slots dropped): never True; at cf4432e refused for the int64[u0] counts instead
    "BincountCapacityDropping": "counts sent are not the number of top-k slots per expert",
}


def _forward_backward(fn, block, x, rank):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    # a random cotangent: a plain .sum() gives stride-0 grads that CPU _grouped_mm's backward rejects
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))
    (out.float() * g).sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.clone(), grads


def _counts_length(block, x) -> str:
    """What the fullgraph Dynamo graph knows of the bincount counts' length: bounded, pinned or static."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(FLAGS):  # this capturing backend is not moepass: it gets no flags of moepass's
        torch.compile(block, backend=record, fullgraph=True)(x)
    (gm,) = graphs
    lengths = [n.meta["example_value"].shape[0] for n in gm.graph.nodes if n.target is torch.bincount]
    if not lengths:
        return "static"
    return "pinned" if all(isinstance(n, int) or n.node.maybe_as_int() is not None for n in lengths) else "bounded"


def check_block(rank, world_size, name, inductor=False, empty_rank=None, dynamic=None):
    import moepass

    block = ep_catalog_bounded.build(name, dist.group.WORLD)
    batch = 0 if rank == empty_rank else 2
    x = torch.randn(batch, 8, 64, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)
    if empty_rank is None:  # an empty batch traces its own graph; the claim is about the example's
        assert _counts_length(block, x) == ep_catalog_bounded.COUNTS_LENGTH[name]
    want = _forward_backward(block, block, x, rank)
    reference = ep_catalog_bounded.reference(block, x) if rank != empty_rank else None
    torch._dynamo.reset()
    options = {"passes": ["deepep"]} if inductor else {"passes": ["deepep"], "inductor": False}
    with moepass.collecting() as report:
        compiled = torch.compile(block, backend="moepass", options=options, fullgraph=True, dynamic=dynamic)
        got = _forward_backward(compiled, block, x, rank)
    d = report.to_dict()
    (deepep,) = [p for p in d["passes"] if p["name"] == "deepep"]
    a2a_left = sum(v for k, v in d["ops_after"].items() if "all_to_all_single" in k)
    outcome = f"{name}: replaced={deepep['replaced']} skipped={[s['reason'] for s in deepep['skipped']]}"
    if rank == 0:
        print(outcome)  # what the pass did, for `pytest -s`
    expect = EXPECT_REWRITTEN[name]
    assert expect is not True or ep_catalog_bounded.DEEPEP_REGION[name][0]  # a non-region is never rewritten
    if expect is True:
        assert deepep["replaced"] == 1 and deepep["skipped"] == [], f"flip EXPECT_REWRITTEN? {outcome}"
        assert d["ops_after"]["moepass.ep_dispatch"] == 1, d["ops_after"]
        # the token all-to-alls are gone; the counts one may stay where its splits are read outside the region
        kept = "counts all-to-all kept" in deepep["rewrites"][0]["detail"]
        assert a2a_left == int(kept), (deepep["rewrites"], d["ops_after"])
    else:
        assert deepep["replaced"] == 0, f"the pass now rewrites it: flip EXPECT_REWRITTEN[{name!r}]. {outcome}"
        assert any(expect in s["reason"] for s in deepep["skipped"]), outcome
        assert a2a_left == 3, d["ops_after"]
    (out, x_grad, grads), (ref_out, ref_x_grad, ref_grads) = got, want
    if rank != empty_rank:  # ep_catalog.reference takes no empty batch (reshape(0, -1))
        torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    assert grads.keys() == ref_grads.keys()
    for key, grad, ref in [("x", x_grad, ref_x_grad)] + [(n, grads[n], ref_grads[n]) for n in grads]:
        if ref.numel() == 0:  # an empty batch's x grad
            assert grad.numel() == 0, key
            continue
        scale = ref.abs().max().float().clamp_min(1e-6)
        assert (grad.float() - ref.float()).abs().max() <= scale / 32, key


def test_catalog_holds_bounded_deepep_regions():
    regions = [n for n, (region, _) in ep_catalog_bounded.DEEPEP_REGION.items() if region]
    assert sum(ep_catalog_bounded.COUNTS_LENGTH[n] == "bounded" for n in regions) >= 5
    assert all(ep_catalog_bounded.CATALOG[n][1] == (n in regions) for n in ep_catalog_bounded.CATALOG)
    assert set(EXPECT_REWRITTEN) == set(ep_catalog_bounded.CATALOG)
    assert all(expect is True or isinstance(expect, str) and expect for expect in EXPECT_REWRITTEN.values())
    assert not any(EXPECT_REWRITTEN[n] is True for n in ep_catalog_bounded.CATALOG if n not in regions)


@pytest.mark.parametrize("name", list(ep_catalog_bounded.CATALOG))
def test_bounded_catalog_block(name, rank_pool):
    rank_pool(2).run(check_block, name)


@pytest.mark.extended  # CI compiles a bounded-count region with Inductor, its check firing, in test_bounded_counts.py
def test_plain_block_through_inductor(rank_pool):
    """The plain spelling with Inductor after the rewrite (options={"passes": ["deepep"]})."""
    rank_pool(2).run(check_block, "BincountTolistIndexAdd", True)


# DeepSeek-V3's Gate cannot take 0 tokens (view(0, n_groups, -1)), as in its own code
@pytest.mark.parametrize("name", ["BincountTolistIndexAdd", "Llama4ScoresBeforeBincount"])
def test_bounded_block_with_an_empty_batch_on_one_rank(name, rank_pool):
    """Rank 0 has no tokens (bincount of no ids still gives E counts): both ranks must take the same path."""
    rank_pool(2).run(check_block, name, False, 0)


def test_plain_block_with_dynamic_token_count(rank_pool):
    """dynamic=True: the token count is a symbol too, next to the counts' unbacked length."""
    rank_pool(2).run(check_block, "BincountTolistIndexAdd", False, None, True)
