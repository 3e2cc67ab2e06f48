"""Tensor parallelism: moepass's low-precision GEMMs on DTensor shards, on 2 (and 4) gloo CPU ranks.

Op level (moepass/ops/lowp/sharding.py): a colwise MXFP8 linear is the unsharded one bit for bit (its 1x32 blocks run
along the unsharded K); a rowwise one differs only by the bf16 rounding of each rank's partial sum; FP8-rowwise
scales per shard of K are no worse than unsharded; blockwise FP8 shards of whole 128-element tiles and 128x128 blocks
keep the unsharded tiles and blocks. Pass level: the setup that crashed the compile before
(`parallelize_module` with ColwiseParallel / RowwiseParallel on moepass's own model) compiles, rewrites and trains,
and a shard whose K is not a multiple of the MXFP8 block stays BF16 with the reason.

Model level: torchtitan 0.3.0's own DeepSeek-V3, parallelized by torchtitan (its TP plans, sequence parallel, EP,
FSDP2, AC), compiled per block with moepass, against the same model unsharded with moepass, on one batch:
the same rewrites (counts per pass; the deepep pass compared with EP on both sides), the loss within 0.5%, and the
logits and every gradient no further from unsharded than unsharded moepass moves when its weights are nudged by
a bf16 ulp (the floor below which a difference is rounding, not numerics: FP8 quantization turns any rounding
difference upstream into up to an e4m3 step of the elements it tips). Top-k = E, so no near-tie in the router
flips a token's experts.

torchtitan 0.3.0 needs torch >= 2.12; its tests skip on older torch (the op and pass checks run everywhere).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import compile_caches_off
from rank_shared import computed_apart, rank_pool, waiting_group  # noqa: F401  (rank_pool: a fixture)

import moepass.ops  # noqa: F401  (registers the ops)

BF16 = torch.bfloat16
ops = torch.ops.moepass
CHECK_TIMEOUT_S = 600
TITAN = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 12)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))


def _operands(seed: int, tokens: int = 64, k: int = 256, n: int = 128):
    gen = torch.Generator().manual_seed(seed)  # the same on every rank
    x = torch.randn(tokens, k, generator=gen).to(BF16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(BF16)
    g = torch.randn(tokens, n, generator=gen).to(BF16)
    return x, w, g


def _linear_step(op_args, x, w, g, x_place=None, w_place=None, op=None):
    """y and the grads of x and w of one moepass linear, on DTensors when placements are given (then made whole)."""
    from torch.distributed.tensor import distribute_tensor

    if x_place:
        x, w = distribute_tensor(x, _mesh(), x_place), distribute_tensor(w, _mesh(), w_place)
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    op = op or (ops.mxfp8_linear if op_args[0] == "rceil" else ops.fp8_rowwise_linear)
    y = op(x, w, None, *op_args)
    placements = getattr(y, "placements", None)
    y.backward(g if x_place is None else distribute_tensor(g, _mesh(), [_grad_placement(placements[0])]))
    whole = (lambda t: t.full_tensor()) if x_place else (lambda t: t)
    return whole(y), whole(x.grad), whole(w.grad), placements


def _grad_placement(out_placement):
    from torch.distributed.tensor import Replicate

    return Replicate() if out_placement.is_partial() else out_placement


MXFP8_ARGS = ("rceil", False, "emulated")


def check_colwise_mxfp8_linear_is_unsharded_bit_for_bit(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard

    x, w, g = _operands(0)
    y_ref, gx_ref, gw_ref, _ = _linear_step(MXFP8_ARGS, x, w, g)
    y, gx, gw, placements = _linear_step(MXFP8_ARGS, x, w, g, [Replicate()], [Shard(0)])
    assert placements == (Shard(1),), placements  # as mm gives: no communication added
    assert torch.equal(y, y_ref), (y - y_ref).abs().max()  # blocks along K, which colwise does not split
    assert torch.equal(gw, gw_ref)  # wgrad: blocks along tokens, unsplit; each rank's rows of grad_W
    # dgrad: a Partial over N, each rank's sum rounded to bf16 before the two are added: an ulp at its scale
    torch.testing.assert_close(gx, gx_ref, rtol=2**-7, atol=2**-7 * gx_ref.abs().max().item())


def check_rowwise_mxfp8_linear_within_bf16_rounding(rank, world_size):
    from torch.distributed.tensor import Shard

    x, w, g = _operands(1)
    y_ref, gx_ref, gw_ref, _ = _linear_step(MXFP8_ARGS, x, w, g)
    y, gx, gw, placements = _linear_step(MXFP8_ARGS, x, w, g, [Shard(1)], [Shard(1)])
    assert placements[0].is_partial(), placements  # rowwise: each rank's K shard, summed after
    # K/2 = 128 per shard: the same 1x32 blocks; only the bf16 rounding of the two partial sums differs
    torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=2e-2)
    assert torch.equal(gw, gw_ref)  # grad_W's columns are K: each rank's shard of it, blocks along tokens
    assert torch.equal(gx, gx_ref)  # dgrad reduces over N, unsplit; each rank's K columns


def check_fp8_rowwise_scales_per_shard_no_worse(rank, world_size):
    """Rowwise TP splits K: each row's FP8 scale comes from its shard's amax, never coarser than the whole row's."""
    from torch.distributed.tensor import Shard

    def errors(x, w, g):
        exact = x.float() @ w.float().t()
        y_ref = _linear_step((False, "emulated"), x, w, g)[0]
        y = _linear_step((False, "emulated"), x, w, g, [Shard(1)], [Shard(1)])[0]
        return ((y.float() - exact).norm() / exact.norm()).item(), ((y_ref.float() - exact).norm() / exact.norm()).item()

    x, w, g = _operands(2)
    err, err_ref = errors(x, w, g)  # e4m3's relative precision does not depend on the scale: the same, up to the
    assert err <= err_ref * 1.01, (err, err_ref)  # bf16 rounding of each rank's partial sum
    # activation outliers 2^14 above the rest in the first shard's columns (weights as much smaller there): one
    # scale per whole row pushes every other column into e4m3's subnormals; per shard, only the first shard's
    x[:, :8], w[:, :8] = x[:, :8] * 2**14, w[:, :8] / 2**14
    err, err_ref = errors(x, w, g)
    assert err < 0.9 * err_ref, f"per-shard scales: relative error {err:.3g} vs unsharded {err_ref:.3g}"


def check_colwise_grouped_mm_is_unsharded_bit_for_bit(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(96, 128, generator=gen).to(BF16)
    w_t = (torch.randn(4, 128, 64, generator=gen) / 128**0.5).to(BF16)
    offs = torch.tensor([10, 40, 40, 96], dtype=torch.int32)
    ref = ops.mxfp8_grouped_mm(x, w_t, offs, *MXFP8_ARGS)
    mesh = _mesh()
    y = ops.mxfp8_grouped_mm(distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w_t, mesh, [Shard(2)]),
                             distribute_tensor(offs, mesh, [Replicate()]), *MXFP8_ARGS)
    assert y.placements == (Shard(1),), y.placements
    assert torch.equal(y.full_tensor(), ref)


BLOCKWISE_ARGS = (False, "emulated")


def check_blockwise_linear_shards_keep_the_unsharded_tiles_and_blocks(rank, world_size):
    """K and N of 256 over 2 ranks: 128 per shard, whole 1x128 tiles and 128x128 blocks, the unsharded ones."""
    from torch.distributed.tensor import Replicate, Shard

    x, w, g = _operands(5, k=256, n=256)
    step = lambda *places: _linear_step(BLOCKWISE_ARGS, x, w, g, *places, op=ops.blockwise_linear)  # noqa: E731
    y_ref, gx_ref, gw_ref, _ = step()
    y, gx, gw, placements = step([Replicate()], [Shard(0)])  # colwise: W's rows (N) split
    assert placements == (Shard(1),), placements
    assert torch.equal(y, y_ref) and torch.equal(gw, gw_ref)
    torch.testing.assert_close(gx, gx_ref, rtol=2**-7, atol=2**-7 * gx_ref.abs().max().item())  # Partial over N
    y, gx, gw, placements = step([Shard(1)], [Shard(1)])  # rowwise: K split, each rank's K columns of x and W
    assert placements[0].is_partial(), placements
    torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=2**-7 * y_ref.abs().max().item())
    assert torch.equal(gx, gx_ref) and torch.equal(gw, gw_ref)


def check_colwise_blockwise_grouped_mm_is_unsharded_bit_for_bit(rank, world_size):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(200, 128, generator=gen).to(BF16)
    w_t = (torch.randn(3, 128, 256, generator=gen) / 128**0.5).to(BF16)
    offs = torch.tensor([70, 70, 190], dtype=torch.int32)
    ref = ops.blockwise_grouped_mm(x, w_t, offs, *BLOCKWISE_ARGS)
    mesh = _mesh()
    y = ops.blockwise_grouped_mm(distribute_tensor(x, mesh, [Replicate()]), distribute_tensor(w_t, mesh, [Shard(2)]),
                                 distribute_tensor(offs, mesh, [Replicate()]), *BLOCKWISE_ARGS)
    assert y.placements == (Shard(1),), y.placements
    assert torch.equal(y.full_tensor(), ref)


OP_CHECKS = [check_colwise_mxfp8_linear_is_unsharded_bit_for_bit, check_rowwise_mxfp8_linear_within_bf16_rounding,
             check_fp8_rowwise_scales_per_shard_no_worse, check_colwise_grouped_mm_is_unsharded_bit_for_bit,
             check_blockwise_linear_shards_keep_the_unsharded_tiles_and_blocks,
             check_colwise_blockwise_grouped_mm_is_unsharded_bit_for_bit]


@pytest.mark.parametrize("check", OP_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_gemm_ops_on_dtensor_shards(check, rank_pool):
    rank_pool(2).run(check)


# ---------------------------------------------------------------- the passes on a parallelize_module model


def _tp_model(inter_dim: int = 512, n_layers: int = 2):
    """moepass's own debug DeepSeek-V3 (a dense block, then MoE blocks) with every SwiGLU FFN (dense and shared
    experts) tensor parallel, as torchtitan's plans do it: w1/w3 ColwiseParallel, w2 RowwiseParallel."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=n_layers, inter_dim=inter_dim)
    model.init_weights()
    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block.moe.shared_experts if block.moe_enabled else block.feed_forward, _mesh(), plan)
    return model


def _compile_and_train(model, steps: int = 2):
    import moepass

    torch._dynamo.reset()
    for block in model.layers:
        block.compile(backend="moepass")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    # one batch, seen every step: after an SGD step its loss must fall (another batch's loss need not)
    tokens = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with moepass.collecting() as report:
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.roll(-1).flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses, report.to_dict()


def check_parallelize_module_compiles_and_trains(rank, world_size):
    losses, report = _compile_and_train(_tp_model())
    linear = next(p for p in report["passes"] if p["name"] == "linear")
    sharded = [r for r in linear["rewrites"] if "per shard" in r["detail"]]
    assert len(sharded) == 6, linear["rewrites"]  # w1, w2, w3 of the dense FFN and of the shared experts
    assert {"colwise" in r["detail"] for r in sharded} == {True, False}, [r["detail"] for r in sharded]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0], losses


def check_unaligned_shard_stays_bf16_with_reason(rank, world_size):
    # inter_dim 96: each rank holds 48 of the dense FFN's hidden units, not a multiple of MXFP8's 32-element block;
    # the dense block alone (n_layers=1): the MoE block's FFNs are not what this checks
    losses, report = _compile_and_train(_tp_model(inter_dim=96, n_layers=1), steps=1)
    linear = next(p for p in report["passes"] if p["name"] == "linear")
    kept = [s for s in linear["skipped"] if s["module"].startswith("layers.0.feed_forward")]
    assert sorted(s["module"] for s in kept) == [f"layers.0.feed_forward.w{i}" for i in (1, 2, 3)], kept
    assert all("48" in s["reason"] and "per shard" in s["reason"] for s in kept), kept
    assert torch.isfinite(torch.tensor(losses)).all()


@pytest.mark.parametrize("check", [check_parallelize_module_compiles_and_trains,
                                   check_unaligned_shard_stays_bf16_with_reason],
                         ids=lambda c: c.__name__.removeprefix("check_"))
def test_passes_on_parallelize_module_model(check, rank_pool):
    rank_pool(2).run(check, timeout_s=CHECK_TIMEOUT_S)


# ---------------------------------------------------------------- torchtitan's own TP, against unsharded

SIZES = dict(head_dim=32, n_layers=2, n_dense_layers=1, top_k=8)  # every TP shard of K and N a multiple of 32
_references: dict = {}  # per rank process: the unsharded runs every case compares against


def _titan():
    sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
    from realstack import torchtitan_ep as tt

    return tt


def _moepass_step(titan, batch, param_shapes=None):
    import moepass

    tt = _titan()
    torch._dynamo.reset()
    with moepass.collecting() as report, compile_caches_off():
        tt.compile_blocks(titan, "moepass")
        shapes = param_shapes or {tt._plain_name(n): p.shape for n, p in titan.model.named_parameters()}
        result = tt.full_step(titan, *batch, shapes)
    return result, report.to_dict()


def _reference(spmd_backend: str, fsdp: bool, batch, tp: int):
    """moepass on the unsharded model, and on it with weights nudged by a bf16 ulp (built in fp32 then cast
    when the case trains under FSDP2's mixed precision, so both start from the same bf16 weights). The nudge is made
    in place after the first step, so the second runs the same compiled graphs: one compile for both. The first rank
    of each tensor-parallel group (whose ranks share a batch) runs them and sends them to every rank."""
    key = (spmd_backend, fsdp, batch[0].sum().item(), batch[1].sum().item())
    if key not in _references:
        from moepass.harness.converge import nudge_weights

        tt = _titan()
        titan = tt.build_parallel("16B-like", spmd_backend=spmd_backend, **SIZES, **(
            {"dtype": torch.float32} if fsdp else {}))  # on every rank: its device mesh may create process groups
        if fsdp:
            titan.model.to(BF16)

        def unsharded_and_nudged():
            run = _moepass_step(titan, batch)
            nudge_weights(titan.model, seed=7)
            with compile_caches_off():
                nudged = tt.full_step(titan, *batch, {name: g.shape for name, g in run[0].grads.items()})
            return run, (nudged, None)

        leaders = range(0, dist.get_world_size(), tp)
        runs = computed_apart({leader: unsharded_and_nudged for leader in leaders}, waiting_group())
        _references[key] = runs[dist.get_rank() - dist.get_rank() % tp]
    return _references[key]


def _counts(report) -> dict:
    return {p["name"]: (p["replaced"], len(p["skipped"])) for p in report["passes"]}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _summed_over_data_parallel(titan, result):
    """The unsharded reference's gradients as FSDP2 reduces them: summed over the data-parallel ranks (those with
    this rank's tensor-parallel index; torchtitan's gradient divide factor is 1, gloo gets SUM)."""
    tp, world = titan.parallel_dims.tp, dist.get_world_size()
    groups = [dist.new_group(list(range(i, world, tp))) for i in range(tp)]  # every rank joins every new_group
    group = groups[dist.get_rank() % tp]
    grads = {}
    for name, g in result.grads.items():
        grads[name] = g.clone()
        dist.all_reduce(grads[name], group=group)
    return type(result)(result.output, result.loss, grads)


def check_torchtitan_tp_matches_unsharded(rank, world_size, case: dict):
    tt = _titan()
    titan = tt.build_parallel("16B-like", **SIZES, **case)
    batch = tt.example_batch(titan)  # the same on the ranks of a tensor-parallel group
    (ref, ref_report), (nudged, _) = _reference(case.get("spmd_backend", "partial_dtensor"), case.get("fsdp", False),
                                                batch, titan.parallel_dims.tp)
    if case.get("fsdp"):
        ref, nudged = _summed_over_data_parallel(titan, ref), _summed_over_data_parallel(titan, nudged)
    got, report = _moepass_step(titan, batch, param_shapes={name: g.shape for name, g in ref.grads.items()})
    counts, ref_counts = _counts(report), _counts(ref_report)
    if case.get("ep", 1) > 1:  # an EP region exists only with EP: it is replaced, nothing else is left alone
        assert counts.pop("deepep") == (1, 0), report["passes"]
        ref_counts.pop("deepep")
    assert counts == ref_counts, (counts, ref_counts)
    assert abs(got.loss.item() - ref.loss.item()) <= 5e-3 * abs(ref.loss.item()), (got.loss, ref.loss)
    floor = _rel(nudged.output, ref.output)
    assert _rel(got.output, ref.output) <= floor, (_rel(got.output, ref.output), floor)
    assert got.grads.keys() == ref.grads.keys()
    floors = {n: _rel(g, ref.grads[n]) for n, g in nudged.grads.items()}
    if case.get("fsdp"):
        # Under FSDP2 x TP the same layout with no moepass rewrite (passes=[]) is further from unsharded than the
        # nudge in attention.wq's gradient (0.27 against 0.03-0.09; torchtitan's 2-D sharding or this test's
        # gathering of _StridedShard gradients, not yet diagnosed, not moepass's doing). moepass must then be no
        # further from unsharded than that BF16 run of the same layout is.
        bf16 = _bf16_step(tt, case, batch, {name: g.shape for name, g in ref.grads.items()})
        floors = {n: max(f, _rel(bf16.grads[n], ref.grads[n])) for n, f in floors.items()}
    worse = {n: (_rel(g, ref.grads[n]), floors[n]) for n, g in got.grads.items() if _rel(g, ref.grads[n]) > 1.5 * floors[n]}
    assert not worse, f"gradients further from unsharded than a bf16-ulp nudge moves them (got, floor): {worse}"


def _bf16_step(tt, case: dict, batch, param_shapes):
    """The same layout, built again, through the backend with no pass (plain BF16 under Inductor)."""
    from moepass.options import ENV_VAR

    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = '{"passes": []}'
    try:
        result, report = _moepass_step(tt.build_parallel("16B-like", **SIZES, **case), batch, param_shapes)
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR)
        else:
            os.environ[ENV_VAR] = previous
    assert all(p["replaced"] == 0 for p in report["passes"]), report["passes"]
    return result


def _case(name, marks=(), world_size=2, **case):
    return pytest.param(world_size, case, id=name, marks=list(marks))


EXTENDED = (pytest.mark.extended,)
# in CI (it must stay under 15 minutes on 2 cores): EP x TP + SP on DTensors under selective AC, the case that
# crosses every layer (DTensor strategies, the EP analysis on local shards, AC translation); the rest of the
# matrix under pytest -m extended
TITAN_CASES = [
    _case("ep_tp_selective_ac", tp=2, ep=2, ac="selective"),
    _case("tp_sp", EXTENDED, tp=2),
    _case("tp_spmd_types", EXTENDED, tp=2, spmd_backend="spmd_types"),
    _case("tp_no_sp", EXTENDED, tp=2, sp=False),
    _case("tp_sp_full_ac", EXTENDED, tp=2, ac="full"),
    _case("tp_sp_selective_ac", EXTENDED, tp=2, ac="selective"),
    _case("ep_tp", EXTENDED, tp=2, ep=2),
    _case("ep_tp_full_ac", EXTENDED, tp=2, ep=2, ac="full"),
    _case("tp_spmd_types_selective_ac", EXTENDED, tp=2, spmd_backend="spmd_types", ac="selective"),
    # 4 ranks: FSDP2 over 2 data-parallel ranks x TP 2, as torchtitan's parallelize_deepseekv3 builds it
    _case("fsdp_tp", EXTENDED, world_size=4, tp=2, fsdp=True),
    _case("fsdp_tp_selective_ac", EXTENDED, world_size=4, tp=2, fsdp=True, ac="selective"),
    _case("ep_fsdp_tp", EXTENDED, world_size=4, tp=2, ep=2, fsdp=True),
    _case("ep_fsdp_tp_full_ac", EXTENDED, world_size=4, tp=2, ep=2, fsdp=True, ac="full"),
]


@pytest.mark.skipif(not TITAN, reason="torchtitan 0.3.0 needs torch >= 2.12")
@pytest.mark.parametrize("world_size, case", TITAN_CASES)
def test_torchtitan_tensor_parallel_matches_unsharded(world_size, case, rank_pool):
    pytest.importorskip("torchtitan")
    rank_pool(world_size).run(check_torchtitan_tp_matches_unsharded, case, timeout_s=CHECK_TIMEOUT_S)
