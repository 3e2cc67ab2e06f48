"""Expert parallelism at 4, 8 and 16 gloo ranks: the deepep pass on DeepSeek-V3's node-limited routing.

A tiny DeepSeek-V3 (one MoE block) with DeepSeek-V3's routing shape scaled down: 64 experts in 8
groups, each token limited to its 4 best groups, top-4 of sigmoid scores (671B: 256 / 8 / 4 / 8). EP over every rank
(16 experts a rank at 4 ranks, one group a rank at 8, a group over two ranks at 16), each block compiled on its own
with `backend="moepass"` (as torchtitan compiles), the passes and ops run eagerly (`inductor: False`; one extended
case under Inductor). Each rank feeds its own 2 x 8 tokens; the EP=1 model, compiled the same way, runs the whole
batch in the test process. The routed experts' weights are scaled up (as parameters) so that they move the logits.

Routings, set through the router's `expert_bias` (the aux-loss-free balancing bias: it moves which experts are
chosen, never their weights; the model class is untouched), all through the same compiled graphs:
- balanced: no bias;
- experts_without_tokens: every other expert biased away: every rank receives rows, half its experts none;
- ranks_without_tokens: the odd ranks' experts biased away: half the ranks receive nothing;
- one_rank_gets_all: rank 0's first 4 experts biased in: every token goes to rank 0 only, which then runs 4 of its
  experts and leaves the others empty.
What each routing really did (rows per rank, empty experts) is checked on the EP=1 model, not assumed.

Compared with the EP=1 model, on every rank and routing: the logits of the rank's tokens, the routed experts'
gradients (this rank's slice) and the replicated gradients summed over the ranks (the data-parallel sum; under FSDP2
its reduce-scatter's average times the ranks), with the reference dispatch under MXFP8 and with quantize_once's FP8
rows dispatched (FP8-rowwise, against the EP=1 model with the same recipe); under full and selective AC; with FSDP2
over the same ranks. The tolerances and why: next to their constants below.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from rank_shared import rank_pool  # noqa: F401  (a fixture)

BF16 = torch.bfloat16
# one MoE block and no dense block (a second compile per rank, no EP in it): the replicated gradients the dispatch's
# backward returns still reach the block's attention and the embeddings upstream
SIZES = {"n_layers": 1, "n_dense_layers": 0, "dim": 64, "inter_dim": 64, "moe_inter_dim": 32, "n_heads": 2,
         "kv_lora_rank": 32, "vocab_size": 256, "n_routed_experts": 64, "n_expert_groups": 8, "n_limited_groups": 4,
         "n_activated_experts": 4, "n_shared_experts": 1}
MOE_LAYER = SIZES["n_layers"] - 1
BATCH, SEQ_LEN = 2, 8  # per rank
ROUTINGS = ("balanced", "experts_without_tokens", "ranks_without_tokens", "one_rank_gets_all")
BIAS = 100.0  # far beyond any sigmoid score difference (scores are in (0, 1))
# Tolerances (measured worst in .notes/ep_scale.md). Eager (inductor: False) without FSDP2 the EP model computes what
# the EP=1 model computes: the same rows reach each expert in the same order (source rank, then token), so the logits
# and the routed experts' gradients match to an ulp (measured bit-equal at 4, 8 and 16 ranks).
LOGITS_TOL = dict(rtol=2**-7, atol=2**-10)
EXPERT_TOL = 2**-8
# Replicated gradients (summed over the ranks in fp32): the EP=1 model accumulates a token's K expert-row gradients
# into x's gradient in BF16 (the backward of x[token_of_slot]); the rewrite sums them per destination rank, then over
# ranks in fp32 (DeepEP's combine, dispatch's backward). One BF16 ulp apart (0.7% measured with BF16 GEMMs), which
# MXFP8 / FP8 quantization of the gradients upstream turns into E4M3 steps of the elements it tips (3.7% measured).
REPLICATED_TOL = 2**-4
# FSDP2 alone moves BF16 GEMM results by an ulp (measured without moepass: its gathered weights), and Inductor fuses
# the EP and EP=1 graphs differently: the same ulps, tipped into E4M3 steps, reach logits and experts' gradients too.
LOGITS_TOL_ULPS_MOVED = dict(rtol=2**-6, atol=2**-4)
EXPERT_TOL_ULPS_MOVED = 2**-4
BACKENDS = {
    # the reference (torch.distributed) dispatch, every default pass: MXFP8 GEMMs (emulated on CPU)
    "reference": {"inductor": False, "deepep.backend": "reference"},
    # quantize_once sends FP8 rows and their scales through the dispatch
    "fp8_dispatch": {"inductor": False, "deepep.backend": "reference", "recipe": "fp8_rowwise",
                     "fp8_rowwise.kernel": "emulated", "fp8_rowwise.wgrad_bf16": False},
    # the same as "reference", compiled by Inductor (unbacked row counts, zero-row ranks in generated code)
    "reference_inductor": {"deepep.backend": "reference"},
}
CHECK_TIMEOUT_S = 420
EXPERT_SCALE = 8.0  # at init the routed experts move the logits by 0.1% RMS (under BF16 steps on the residual); x8: 27%


def _model(ep_group=None):
    """The tiny DeepSeek-V3, routed expert weights scaled up (set as parameters) so that their output shows."""
    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", **SIZES)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".moe.experts." in name:
                param.mul_(EXPERT_SCALE)
    if ep_group is None:
        return model
    sharded = build_model("debug", ep_group=ep_group, **SIZES)
    sharded.load_full_state_dict(model.state_dict())
    return sharded


def _batch(world_size: int):
    """Every rank's tokens (rank-major) and a fixed cotangent of the logits."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SIZES["vocab_size"], (world_size * BATCH, SEQ_LEN), generator=gen)
    cotangent = torch.randn(world_size * BATCH, SEQ_LEN, SIZES["vocab_size"], generator=gen)
    return tokens, cotangent


def expert_bias(routing: str, world_size: int) -> torch.Tensor:
    experts, per_rank = SIZES["n_routed_experts"], SIZES["n_routed_experts"] // world_size
    bias = torch.zeros(experts)
    owner = torch.arange(experts) // per_rank
    if routing == "experts_without_tokens":
        bias[1::2] = -BIAS
    elif routing == "ranks_without_tokens":
        bias[owner % 2 == 1] = -BIAS
    elif routing == "one_rank_gets_all":
        bias[: SIZES["n_activated_experts"]] = BIAS
    return bias


def _set_routing(model, routing: str, world_size: int) -> None:
    for router in (m for n, m in model.named_modules() if n.endswith("moe.router")):
        router.expert_bias.copy_(expert_bias(routing, world_size))


def _capture_flags():
    # EP regions need host split sizes and data-dependent row counts in one graph; set here, not relied on at import
    return torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True,
                                      skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def _compile_blocks(model, options) -> None:
    for block in model.layers:  # each on its own, as torchtitan compiles
        block.compile(backend="moepass", options=options)


def _plain(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


# ---------------------------------------------------------------- the EP=1 model, in the test process


def routing_rows(world_size: int, routing: str) -> tuple[list[int], list[int]]:
    """(rows each rank receives, tokens each expert receives) under `routing`, on the uncompiled EP=1 model: one row
    per (token, destination rank), as DeepEP sends them."""
    model = _model()
    _set_routing(model, routing, world_size)
    seen = []
    router = model.layers[MOE_LAYER].moe.router
    handle = router.register_forward_hook(lambda mod, args, out: seen.append(out[1]))
    with torch.no_grad():
        model(_batch(world_size)[0])
    handle.remove()
    (ids,) = seen
    per_rank = SIZES["n_routed_experts"] // world_size
    ranks_of_token = [set((row // per_rank).tolist()) for row in ids]
    rows = [sum(r in ranks for ranks in ranks_of_token) for r in range(world_size)]
    tokens_per_expert = torch.bincount(ids.flatten(), minlength=SIZES["n_routed_experts"]).tolist()
    return rows, tokens_per_expert


def _assert_routing_happened(world_size: int, routing: str) -> None:
    rows, per_expert = routing_rows(world_size, routing)
    per_rank = SIZES["n_routed_experts"] // world_size
    if routing == "balanced":
        assert min(rows) > 0, rows
    elif routing == "experts_without_tokens":  # every rank receives rows, for half of its experts only
        assert min(rows) > 0 and per_expert[1::2] == [0] * (len(per_expert) // 2), (rows, per_expert)
    elif routing == "ranks_without_tokens":
        assert all(n == 0 for n in rows[1::2]) and all(n > 0 for n in rows[::2]), rows
    else:
        assert rows[0] == world_size * BATCH * SEQ_LEN and not any(rows[1:]), rows
        assert per_expert[:per_rank].count(0) == per_rank - SIZES["n_activated_experts"], per_expert[:per_rank]


def ep1_reference(world_size: int, options: dict) -> dict:
    """routing -> (logits, {parameter: gradient}) of the EP=1 model on every rank's tokens, blocks compiled alike."""
    torch._dynamo.reset()
    model = _model()
    _compile_blocks(model, options)
    tokens, cotangent = _batch(world_size)
    results = {}
    for routing in ROUTINGS:
        _set_routing(model, routing, world_size)
        model.zero_grad(set_to_none=True)
        logits = model(tokens)
        (logits.float() * cotangent).sum().backward()
        results[routing] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch._dynamo.reset()
    return results


# ---------------------------------------------------------------- each rank


def _selective_policy(ctx, func, *args, **kwargs):
    """torchtitan-style op SAC: GEMM and all-to-all outputs saved, everything else recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {torch.ops.aten.mm.default, torch.ops.aten._grouped_mm.default,
             torch.ops._c10d_functional.all_to_all_single.default}
    return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap_ac(model, ac: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for i, block in enumerate(model.layers):
        if ac == "full":
            model.layers[i] = checkpoint_wrapper(block)
        elif ac == "selective":
            context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
            model.layers[i] = checkpoint_wrapper(block, context_fn=context_fn)


def _shard_fsdp2(model) -> None:
    """FSDP2 over every rank on the dense and replicated weights (the routed experts are EP-sharded already)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    experts = {p for n, p in model.named_parameters() if ".moe.experts." in n}
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=mp, ignored_params=experts)
    fully_shard(model, mp_policy=mp, ignored_params=experts)
    for module in model.modules():
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _grad_gaps(model, want: dict, rank: int, world_size: int, fsdp: bool) -> dict[str, float]:
    from torch.distributed.tensor import DTensor

    from moepass.models.expert_parallel import shard_experts

    gaps = {}
    for name, param in model.named_parameters():
        name = _plain(name)
        ref = want[name]
        grad = param.grad
        if ".moe.experts." in name:
            gaps[name] = _rel(grad, shard_experts(ref, rank, world_size))
        elif isinstance(grad, DTensor):
            gaps[name] = _rel(grad.full_tensor().float() * world_size, ref)  # FSDP2 averages over the ranks
        else:
            total = grad.float()
            dist.all_reduce(total)
            gaps[name] = _rel(total, ref)
    return gaps


def check_ep_matches_ep1(rank, world_size, backend, ac, fsdp, reference):
    import moepass

    torch._dynamo.reset()
    options = BACKENDS[backend]
    model = _model(ep_group=dist.group.WORLD)
    _wrap_ac(model, ac)
    _compile_blocks(model, options)
    if fsdp:
        _shard_fsdp2(model)
    tokens, cotangent = _batch(world_size)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    ulps_moved = fsdp or options.get("inductor", True)
    logits_tol = LOGITS_TOL_ULPS_MOVED if ulps_moved else LOGITS_TOL
    expert_tol = EXPERT_TOL_ULPS_MOVED if ulps_moved else EXPERT_TOL
    worst = {}
    with _capture_flags(), moepass.collecting() as report:
        for routing in ROUTINGS:
            _set_routing(model, routing, world_size)
            model.zero_grad(set_to_none=True)
            logits = model(tokens[mine])
            (logits.float() * cotangent[mine]).sum().backward()
            want_logits, want_grads = reference[routing]
            torch.testing.assert_close(logits, want_logits[mine], **logits_tol, msg=lambda m: f"{routing}: {m}")
            gaps = _grad_gaps(model, want_grads, rank, world_size, fsdp)
            experts = {n: g for n, g in gaps.items() if ".moe.experts." in n}
            replicated = {n: g for n, g in gaps.items() if n not in experts}
            expert_name, name = max(experts, key=experts.get), max(replicated, key=replicated.get)
            assert experts[expert_name] <= expert_tol, (routing, expert_name, experts[expert_name])
            assert replicated[name] <= REPLICATED_TOL, (routing, name, replicated[name])
            out_gap = (logits.float() - want_logits[mine].float()).abs().max().item()
            worst[routing] = (out_gap, experts[expert_name], name, replicated[name])

    passes = {p["name"]: p for p in report.to_dict()["passes"]}
    assert passes["deepep"]["replaced"] >= 1 and passes["deepep"]["skipped"] == [], passes["deepep"]
    rewrites = passes["deepep"]["rewrites"]
    assert all(r["module"] == f"layers.{MOE_LAYER}.moe" for r in rewrites), rewrites
    ops = report.to_dict()["ops_after"]
    assert not [k for k in ops if "all_to_all" in k], ops
    dispatch = "moepass.ep_dispatch_quantized" if backend == "fp8_dispatch" else "moepass.ep_dispatch"
    assert ops.get(dispatch, 0) >= 1, ops
    print(f"[ep {backend} ac={ac} fsdp={fsdp} x{world_size}] rank {rank}: " + "; ".join(
        f"{r}: logits {o:.1e}, experts {e:.1e}, replicated {g:.1e} ({n})" for r, (o, e, n, g) in worst.items()),
        flush=True)


@functools.cache
def _check_routings(world_size: int) -> None:
    """What each routing does depends on the rank count only: checked once per rank count, for every case (a
    failure raises, so it is not cached)."""
    for routing in ROUTINGS:
        _assert_routing_happened(world_size, routing)


@functools.cache
def _ep1_reference(world_size: int, backend: str) -> dict:
    """The EP=1 run depends on the rank count and the backend's options only (AC and FSDP2 are the EP side's): the
    cases sharing both compare against one run."""
    return ep1_reference(world_size, BACKENDS[backend])


def _run(rank_pool, world_size, backend, ac="none", fsdp=False):
    ranks = rank_pool(world_size)  # first: a new pool's ranks start up while this process runs the EP=1 model
    _check_routings(world_size)
    reference = _ep1_reference(world_size, backend)
    ranks.run(check_ep_matches_ep1, backend, ac, fsdp, reference, timeout_s=CHECK_TIMEOUT_S)


EXTENDED = pytest.mark.extended


@pytest.mark.parametrize("world_size, backend, ac, fsdp", [
    (4, "reference", "none", False),
    (4, "fp8_dispatch", "full", False),
    (4, "reference", "selective", True),
    pytest.param(8, "reference", "none", False, marks=EXTENDED),  # 8 rank processes on CI's 2 cores: a minute
    pytest.param(8, "fp8_dispatch", "selective", False, marks=EXTENDED),
    pytest.param(8, "reference", "full", True, marks=EXTENDED),
    pytest.param(16, "reference", "none", False, marks=EXTENDED),
    pytest.param(16, "fp8_dispatch", "full", False, marks=EXTENDED),
    pytest.param(16, "reference", "selective", True, marks=EXTENDED),
    pytest.param(4, "reference_inductor", "none", False, marks=EXTENDED),
])
def test_ep_at_scale_matches_ep1(world_size, backend, ac, fsdp, rank_pool):
    _run(rank_pool, world_size, backend, ac, fsdp)


# ---------------------------------------------------------------- one expert per rank (as many ranks as experts)


def check_one_expert_per_rank(rank, world_size):
    """Megatron's SequentialMLP with one local expert: torch.split(rows, [count]) is the whole input, so the experts
    read no group sizes at all. The region is still DeepEP's and must be rewritten (it was refused at 8 ranks)."""
    import ep_catalog_unseen

    import moepass

    block = ep_catalog_unseen.build("SequentialMLPSplitLoop", dist.group.WORLD, experts=world_size)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(100 + rank)).to(BF16)

    def forward_backward(fn):
        block.zero_grad(set_to_none=True)
        leaf = x.detach().clone().requires_grad_()
        out = fn(leaf)
        (out.float() * torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))).sum().backward()
        return out.detach(), {"x": leaf.grad, **{n: p.grad for n, p in block.named_parameters()}}

    want_out, want_grads = forward_backward(block)
    torch._dynamo.reset()
    with _capture_flags(), moepass.collecting() as report:
        out, grads = forward_backward(torch.compile(block, backend="moepass", fullgraph=True,
                                                    options={"passes": ["deepep"], "inductor": False}))
    d = report.to_dict()
    (deepep,) = [p for p in d["passes"] if p["name"] == "deepep"]
    assert deepep["replaced"] == 1 and deepep["skipped"] == [], deepep
    assert not [k for k in d["ops_after"] if "all_to_all" in k], d["ops_after"]
    # the catalog's tolerances (tests/integration/test_ep_catalog.py): bf16 rows summed in fp32 by the rewrite, in bf16 here
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        assert (grad.float() - want_grads[name].float()).abs().max() <= want_grads[name].abs().max().float() / 32, name


def test_one_expert_per_rank_is_rewritten(rank_pool):
    rank_pool(4).run(check_one_expert_per_rank, timeout_s=CHECK_TIMEOUT_S)
