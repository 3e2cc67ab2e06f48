"""torchtitan 0.3.0's own expert-parallel DeepSeek-V3, parallelized by torchtitan, compiled with moepass.

The model, its AllToAllTokenDispatcher, EP sharding (ParallelDims(dp_shard=-1, ep=2)), activation
checkpointing (FullAC, and SelectiveAC: torchtitan's op-level policy) and FSDP2 are torchtitan's own code,
unmodified (tests/fixtures/realstack/torchtitan_ep.py says what is configured and why). Per-block compile as
torchtitan's apply_compile does it, on 2 gloo ranks.

Checked per rank, against backend="inductor" on the same weights and batch:
- every EP region is replaced and no all-to-all is left in the rewritten graphs;
- logits and loss within bf16 rounding (atol = rtol = 2e-2), every gradient within 1/32 of its largest value;
- under full and selective AC, the compiled backward graph sends nothing: no all-to-all and no dispatch
  (the rewrite's EP exchanges are saved, not recomputed; its backward is ep_dispatch_backward/_cached).
FSDP2 + EP + per-block compile trains 3 SGD steps with every pass on, losses tracking Inductor's.

torchtitan 0.3.0 needs torch >= 2.12; on older torch (the GPU machine's 2.11) these tests skip.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import compile_caches_off, rank_pool  # noqa: F401  (rank_pool: a fixture)

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is in the [test] extra")
if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12):
    pytest.skip("torchtitan 0.3.0 needs torch >= 2.12", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
from realstack import torchtitan_ep as tt  # noqa: E402

CHECK_TIMEOUT_S = 600


def _train(titan, backend, options=None, steps=1):
    import moepass

    torch._dynamo.reset()
    with moepass.collecting() as report, compile_caches_off():
        results = tt.train_steps(titan, backend, options, steps=steps)
    return results, report.to_dict()


def _assert_close(got, want, where):
    torch.testing.assert_close(got.output, want.output, rtol=2e-2, atol=2e-2, msg=f"logits ({where})")
    torch.testing.assert_close(got.loss, want.loss, rtol=2e-2, atol=2e-2, msg=f"loss ({where})")
    assert got.grads.keys() == want.grads.keys()
    for name, grad in got.grads.items():
        scale = want.grads[name].abs().max().clamp_min(1e-6)
        err = (grad - want.grads[name]).abs().max()
        assert err <= scale / 32, f"{where}: grad {name} differs by {err:.3g} (max {scale:.3g})"


def check_ep_regions_replaced(rank, world_size, flavor, ac):
    (want,), _ = _train(tt.build_moe(flavor, ac=ac), "inductor")
    (got,), report = _train(tt.build_moe(flavor, ac=ac), "moepass", {"passes": ["deepep"]})
    (deepep,) = [p for p in report["passes"] if p["name"] == "deepep"]
    assert deepep["replaced"] == 1 and deepep["skipped"] == [], deepep
    assert not any(g["weights_sharded_by_fsdp"] for g in report["per_graph"])  # EP alone: no FSDP2
    assert "moe.routed_experts" in deepep["rewrites"][0]["module"], deepep["rewrites"]
    assert not [k for k in report["ops_after"] if "all_to_all" in k], report["ops_after"]
    if ac != "none":
        assert report["ops_before"]["tag_activation_checkpoint"] == 1
        assert deepep["rewrites"][0]["node"].startswith("wrap_body")
    backward = [c["ops"] for c in report["compiled_graphs"] if c["kind"] == "backward"]
    assert backward, report["compiled_graphs"]
    for ops in backward:  # nothing is sent again to recompute a checkpointed block
        assert not [k for k in ops if "all_to_all" in k or k == "moepass.ep_dispatch"], ops
        assert ops.get("moepass.ep_dispatch_backward", 0) + ops.get("moepass.ep_combine", 0) == 1, ops
    _assert_close(got, want, f"{flavor}, AC {ac}, rank {rank}")


# Every flavor x AC pair under pytest -m extended (CI has 2 cores and 15 minutes): in CI, torchtitan's EP under
# selective AC is tests/integration/test_tensor_parallel.py's ep_tp_selective_ac (EP x TP on DTensors), its FSDP2 x EP with
# per-block compile tests/integration/test_torchtitan_trainer.py (torchtitan's own trainer)
IN_CI = set()
CASES = [pytest.param(f, ac, marks=[] if (f, ac) in IN_CI else [pytest.mark.extended])
         for f in tt.FLAVORS for ac in tt.AC_KINDS]


@pytest.mark.parametrize("flavor, ac", CASES)
def test_torchtitan_ep_moe_regions_replaced(flavor, ac, rank_pool):
    rank_pool(2).run(check_ep_regions_replaced, flavor, ac, timeout_s=CHECK_TIMEOUT_S)


def check_fsdp2_per_block_trains(rank, world_size):
    want, _ = _train(tt.fsdp_per_block("16B-like"), "inductor", steps=3)
    got, report = _train(tt.fsdp_per_block("16B-like"), "moepass", steps=3)
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["deepep"]["replaced"] >= 1 and passes["grouped_mm"]["replaced"] >= 3, passes
    # FSDP2 gathers each block's weights: the recipes' weights-once sharing stays off for them
    blocks = [g for g in report["per_graph"] if g["module"].startswith("layers")]
    assert blocks and all(g["weights_sharded_by_fsdp"] for g in blocks), report["per_graph"]
    assert not [k for k in report["ops_after"] if "all_to_all" in k]
    losses, ref_losses = [r.loss.item() for r in got], [r.loss.item() for r in want]
    assert all(torch.isfinite(torch.tensor(losses)))
    for loss, ref in zip(losses, ref_losses):  # MXFP8 (emulated) GEMMs: within a few percent of BF16
        assert abs(loss - ref) <= 0.03 * abs(ref), (losses, ref_losses)


@pytest.mark.extended  # CI: the trainer's fsdp_ep2 case compiles the same blocks under FSDP2 x EP
def test_fsdp2_ep_per_block_compile_trains(rank_pool):
    rank_pool(2).run(check_fsdp2_per_block_trains, timeout_s=CHECK_TIMEOUT_S)
