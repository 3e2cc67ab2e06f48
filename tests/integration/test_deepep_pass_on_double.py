"""The deepep pass choosing DeepEP, and quantize_once sending FP8 rows through it, on the deep_ep double (gloo ranks).

DeepEP needs GPUs, so in CI moepass's DeepEP path (the backend choice, moepass/ops/ep/deepep.py, the DeepEP handle
through the ops' schemas, fakes and autograd) runs on tests/fixtures/doubles/deep_ep, DeepEP V1's Buffer over gloo. Checked:
- the debug DeepSeek-V3 with EP=2 rewritten with backend=deepep, forward and backward, against the uncompiled model
  (DeepEP combines in BF16: the GPU test's tolerances), and the same under activation checkpointing (bit for bit);
- quantize_once's FP8 rows through DeepEP (fp8_rowwise's row scale repeated per 128 columns, blockwise's tiles): the
  forward bit-equal to quantizing after the dispatch, the combine and gradients in BF16; MXFP8 keeps its BF16 dispatch;
- 16 ranks as 2 nodes of 8 (LOCAL_WORLD_SIZE=8): DeepEP's internode mode (pytest -m extended).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from doubles import deep_ep_double
from helpers import RankPools, rank_pool  # noqa: F401  (rank_pool: a fixture)

TOLERANCE = dict(rtol=2e-2, atol=6e-2)  # BF16 combine against the model's fp32 sum (tests/gpu/test_deepep_pass_gpu.py)


def _step(model, tokens, options=None, compile_=True):
    """(output, parameter gradients, report) of one forward and backward."""
    import moepass

    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        out = torch.compile(model, backend="moepass", options=options)(tokens) if compile_ else model(tokens)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
        (out.float() * g).sum().backward()
    grads = {_plain(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, report.to_dict()


def _plain(path: str) -> str:
    return path.replace("_checkpoint_wrapped_module.", "")


def _model(n_layers: int, checkpointed: bool = False):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=n_layers, ep_group=dist.group.WORLD)
    if checkpointed:
        for i, layer in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer)
    return model


def _tokens(rank):
    return torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(rank))


def _passes(report) -> dict:
    return {p["name"]: p for p in report["passes"]}


def _assert_close_to(got, want):
    (out, grads, _), (ref_out, ref_grads, _) = got, want
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLERANCE)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().float()
        assert (grad.float() - ref_grads[name].float()).abs().max() <= scale / 32, name


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _assert_bitwise(got, want):
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    assert not [n for n in got[1] if not torch.equal(got[1][n], want[1][n])]


# ---------------------------------------------------------------- the deepep pass picks DeepEP


def check_pass_picks_deepep(rank, world_size):
    with deep_ep_double():
        model = _model(n_layers=3)
        tokens = _tokens(rank)
        want = _step(model, tokens, compile_=False)
        got = _step(model, tokens, {"passes": ["deepep"], "inductor": False})  # deepep.backend: auto
        deepep = _passes(got[2])["deepep"]
        assert deepep["replaced"] == 2 and deepep["skipped"] == [], deepep
        assert deepep["implementations"] == {
            "deepep": "deep_ep double of 567632d importable, 2 ranks on NVLink (intranode)"}
        assert all("backend=deepep" in r["detail"] for r in deepep["rewrites"])
        ops = got[2]["ops_after"]
        assert ops["moepass.ep_dispatch"] == ops["moepass.ep_combine"] == 2
        assert not [k for k in ops if k.endswith(("all_to_all_single", "wait_tensor"))], ops
        _assert_close_to(got, want)

        checkpointed = _model(n_layers=3, checkpointed=True)
        under_ac = _step(checkpointed, tokens, {"passes": ["deepep"], "inductor": False})
        deepep = _passes(under_ac[2])["deepep"]
        assert deepep["replaced"] == 2 and set(deepep["implementations"]) == {"deepep"}, deepep
        assert all(r["node"].startswith("wrap_body") for r in deepep["rewrites"]), deepep["rewrites"]
        # the same ops in the checkpointed bodies; the EP exchanges are saved, not run again, in the backward
        _assert_bitwise(under_ac, got)


def test_deepep_pass_picks_deepep_and_runs_it_forward_backward_and_under_ac(rank_pool):
    rank_pool(2).run(check_pass_picks_deepep, timeout_s=420)


# ---------------------------------------------------------------- FP8 rows through DeepEP


def check_fp8_rows_through_deepep(rank, world_size):
    with deep_ep_double():
        model = _model(n_layers=2)
        tokens = _tokens(rank)
        bf16 = _step(model, tokens, {"passes": ["deepep"], "deepep.backend": "deepep", "inductor": False})
        for recipe, extra in (("fp8_rowwise", {"fp8_rowwise.wgrad_bf16": False}),
                              ("blockwise", {"quantize_once.saved_rows": "fp8"})):
            base = {"recipe": recipe, f"{recipe}.kernel": "emulated", "deepep.backend": "deepep", "inductor": False,
                    **extra}
            want = _step(model, tokens, {**base, "passes": ["deepep", "grouped_mm"]})
            got = _step(model, tokens, {**base, "passes": ["deepep", "grouped_mm", "quantize_once"]})
            quantize_once = _passes(got[2])["quantize_once"]
            sent = [r for r in quantize_once["rewrites"] if r["op"] == "moepass.ep_dispatch_quantized"]
            assert len(sent) == 1 and quantize_once["skipped"] == [], (recipe, quantize_once)
            # 256 e4m3 values and two fp32 scales a row (fp8_rowwise's one scale travels repeated)
            assert "through deepep (264 bytes a row instead of 512)" in sent[0]["detail"], sent[0]
            ops = got[2]["ops_after"]
            assert ops["moepass.ep_dispatch_quantized"] == 1 and "moepass.ep_dispatch" not in ops, ops
            # quantizing before the dispatch gives the bits of quantizing after it; the combine is DeepEP's in BF16
            assert torch.equal(got[0], want[0]), recipe
            for name, grad in got[1].items():
                ref = want[1][name]
                if ".experts." not in name:  # the experts' dgrad is the same op on the same FP8 rows
                    assert torch.equal(grad, ref), (recipe, name)
                elif recipe == "fp8_rowwise":  # its FP8 wgrad on the saved FP8 rows: the same e4m3 values
                    assert _relative(grad, ref) < 1e-3, (recipe, name)
                else:  # blockwise's wgrad on saved FP8 rows is BF16 on their dequantization: no further from BF16
                    assert _relative(grad, bf16[1][name]) <= 1.5 * _relative(ref, bf16[1][name]) + 1e-3, name

        mxfp8 = _step(model, tokens, {"recipe": "mxfp8", "deepep.backend": "deepep", "inductor": False,
                                      "passes": ["deepep", "grouped_mm", "quantize_once"]})
        skipped = _passes(mxfp8[2])["quantize_once"]["skipped"]
        assert skipped and all("no rows form" in s["reason"] for s in skipped), skipped
        assert mxfp8[2]["ops_after"]["moepass.ep_dispatch"] == 1  # MXFP8's experts quantize their own rows


def test_fp8_rows_go_through_deepep_bit_equal_to_quantizing_after_the_dispatch(rank_pool):
    rank_pool(2).run(check_fp8_rows_through_deepep, timeout_s=580)


# ---------------------------------------------------------------- 16 ranks as 2 nodes of 8: DeepEP's internode mode


@pytest.fixture(scope="module")
def two_nodes_of_8():
    """rank_pool for 16 gloo ranks that see LOCAL_WORLD_SIZE=8, as torchrun sets it on each of 2 nodes."""
    pools = RankPools(env={"LOCAL_WORLD_SIZE": "8"})
    yield pools
    pools.close()


def _sum_per_node(values: list[torch.Tensor]) -> torch.Tensor:
    """DeepEP's internode combine of one token: per node an fp32 sum rounded to bf16, then those added in fp32."""
    total = torch.zeros((), dtype=torch.float32)
    for node in range(len(values) // 8):
        partial = torch.zeros((), dtype=torch.float32)
        for v in values[node * 8:(node + 1) * 8]:
            partial = partial + v.float()
        total = total + partial.to(torch.bfloat16).float()
    return total.to(torch.bfloat16)


def check_internode_combine_rounds_per_node(rank, world_size):
    """Even ranks send back 1, odd ranks 2^-8: a node's 1 + 2^-8 rounds to 1 before the other node's share is added.
    Run inside deep_ep_double()."""
    from helpers import combine, destination_ranks, dispatch, make_rank_inputs, problem_for

    problem = problem_for(world_size, "cpu")
    inputs = make_rank_inputs(problem)
    x, topk_idx, topk_weights = inputs[rank]
    value = torch.tensor(1.0 if rank % 2 == 0 else 2.0**-8, dtype=torch.bfloat16)
    recv_x, *_, handle = dispatch(x, topk_idx, topk_weights, problem, "deepep")
    assert len(handle) == 10  # DeepEP's internode handle
    out = combine(torch.full_like(recv_x, value.item()), handle, "deepep")
    differs = 0
    for t, ids in enumerate(topk_idx.tolist()):
        dests = destination_ranks(ids, problem.experts_per_rank)
        values = [torch.tensor(1.0 if d % 2 == 0 else 2.0**-8) if d in dests else torch.tensor(0.0)
                  for d in range(world_size)]
        want = _sum_per_node(values) if dests else torch.tensor(0.0, dtype=torch.bfloat16)
        assert torch.all(out[t] == want), (t, dests, out[t][0], want)
        differs += int(want != sum(values, torch.tensor(0.0)).to(torch.bfloat16))
    differs = torch.tensor([differs])
    dist.all_reduce(differs)
    assert differs.item() > 0, "no token where the per-node rounding shows"


def check_internode_ops(rank, world_size):
    from helpers import (check_autograd, check_combine_of_dispatch_counts_destinations, check_compiled_matches_eager,
                         check_dispatch_semantics)
    from moepass.ops.ep.dispatch_combine import choose_ep_backend

    with deep_ep_double():
        backend, why = choose_ep_backend(dist.group.WORLD, "cpu", 32)
        assert backend == "deepep" and "16 ranks as 2 nodes of 8 (internode" in why, why
        for check in (check_dispatch_semantics, check_combine_of_dispatch_counts_destinations, check_autograd,
                      check_compiled_matches_eager):
            check(rank, world_size, "deepep", "cpu")
        check_internode_combine_rounds_per_node(rank, world_size)
        import moepass.ops.ep.deepep as deepep

        (buffer,) = deepep._buffers.values()
        assert buffer.num_rdma_bytes > 0 and buffer.num_rdma_ranks == 2  # DeepEP's RDMA buffer, sized by its hints
    with deep_ep_double(nvshmem=False):
        backend, why = choose_ep_backend(dist.group.WORLD, "cpu", 32)
        assert backend == "reference" and "built without NVSHMEM" in why and "rebuild DeepEP" in why, why


@pytest.mark.extended  # 16 processes on 2 cores
def test_internode_ops_at_16_ranks_as_2_nodes_of_8(two_nodes_of_8):
    two_nodes_of_8(16).run(check_internode_ops, timeout_s=580)


def check_deepep_pass_across_nodes(rank, world_size):
    """An EP MoE block over 16 ranks (2 nodes of 8): the deepep pass picks DeepEP's internode mode, and the rewritten
    block matches the uncompiled one within the BF16 combine's tolerances, forward and backward."""
    from moepass.models import MoE, get_config

    torch.manual_seed(0)
    config = get_config("debug", n_routed_experts=32, n_expert_groups=4, n_limited_groups=2)
    moe = MoE(config, ep_group=dist.group.WORLD)
    for param in moe.parameters():  # the block alone: no model init
        torch.nn.init.normal_(param, std=0.05)
    x = torch.randn(2, 8, config.dim, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    with deep_ep_double():
        want = _step(moe, x.clone().requires_grad_(), compile_=False)
        got = _step(moe, x.clone().requires_grad_(), {"passes": ["deepep"], "inductor": False})
    deepep = _passes(got[2])["deepep"]
    assert deepep["replaced"] == 1 and deepep["skipped"] == [], deepep
    (why,) = deepep["implementations"].values()
    assert "16 ranks as 2 nodes of 8 (internode" in why, deepep["implementations"]
    _assert_close_to(got, want)


@pytest.mark.extended  # 16 compiles on 2 cores
def test_deepep_pass_across_2_nodes_of_8(two_nodes_of_8):
    two_nodes_of_8(16).run(check_deepep_pass_across_nodes, timeout_s=580)
