"""examples/bench_fp8_bound.py: the recorded GEMMs of a training step, the FP8 replays (same product as the
BF16 call), and the bound's arithmetic. CPU by default; the grouped wgrad's FP8 form needs sm_90."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import scaled_grouped_mm_on_cpu, scaled_mm_on_cpu  # noqa: F401  (fixtures)
from moepass.harness.model_spec import ModelSpec
from moepass.harness.train import next_token_loss

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def bound():
    sys.path.insert(0, os.path.join(REPO, "examples"))  # as `python examples/...` has it: bench_fp8_gemms beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_fp8_bound", os.path.join(REPO, "examples", "bench_fp8_bound.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclass looks its module up by name
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def debug_step(batch=2, seq=48):
    model = ModelSpec("debug", {"n_layers": 2}).build(0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (batch, seq + 1), generator=gen)
    return model, tokens[:, :-1], tokens[:, 1:]


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref, out = ref.double(), out.double()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def test_records_every_gemm_of_a_training_step(bound):
    model, x, y = debug_step()
    calls, vocab = bound.record_step_gemms(model, x, y)
    assert vocab == 2048 and all(p.grad is None for p in model.parameters())

    model, x, y = debug_step()
    with FlopCounterMode(display=False) as counter:  # an independent count of the same step's dense GEMMs
        next_token_loss(model(x), y).backward()
    counted = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    dense = sum(g.flop * n for g, n in calls.items() if g.op != "grouped_mm")
    assert dense == sum(n for op, n in counted.items() if op in ("aten.mm", "aten.addmm", "aten.bmm"))

    roles = {}
    for g, n in calls.items():
        roles.setdefault(g.role(vocab), []).append((g, n))
    assert {"head", "linear", "grouped"} <= set(roles)
    head = roles["head"]  # y = h W^T, its dgrad and its wgrad: one call each
    assert len(head) == 3 and all(n == 1 for _, n in head)
    tokens = x.numel()
    assert {g.flop for g, _ in head} == {2 * tokens * 256 * vocab}
    grouped = [g for g, _ in roles["grouped"]]
    assert {sum(g.groups) for g in grouped} == {tokens * 2} and {len(g.groups) for g in grouped} == {8}  # top-2 of 8
    assert {len(g.shapes[1]) for g in grouped} == {2, 3}  # forward/dgrad 2d-3d and wgrad 2d-2d
    assert any(g.strides[1][-2] == 1 for g in grouped if len(g.shapes[1]) == 3)  # w.transpose(-2,-1) as recorded
    assert sum(n for _, n in roles["grouped"]) == 3 * 3  # one MoE layer: w1, w3, w2, each fwd, dgrad, wgrad


def test_operands_keep_the_recorded_strides(bound):
    g = bound.Gemm("mm", ((64, 32), (32, 48)), ((1, 64), (1, 32)))
    a, b = bound.operands(g, torch.device("cpu"))
    assert a.shape == (64, 32) and a.stride() == (1, 64) and b.stride() == (1, 32) and a.dtype == BF16
    grouped = bound.Gemm("grouped_mm", ((40, 32), (3, 32, 16)), ((32, 1), (512, 1, 32)), (10, 0, 30))
    a, w, offs = bound.operands(grouped, torch.device("cpu"))
    assert w.stride() == (512, 1, 32) and offs.tolist() == [10, 10, 40] and offs.dtype == torch.int32


@pytest.mark.parametrize("strides", [((32, 1), (1, 32)), ((1, 64), (48, 1))])
def test_fp8_linear_replays_compute_the_recorded_product(bound, scaled_mm_on_cpu, strides):  # noqa: F811
    for g in (bound.Gemm("mm", ((64, 32), (32, 48)), strides),
              bound.Gemm("addmm", ((64, 32), (32, 48)), strides, has_bias=True)):
        args = bound.operands(g, torch.device("cpu"))
        ref = bound.bf16_call(g, args)()
        forms = bound.fp8_calls(g, args)
        assert set(forms) == {"tensorwise", "rowwise"}
        for form, call in forms.items():
            out = call()
            assert out.shape == ref.shape == g.out_shape and out.dtype == BF16
            assert sqnr_db(ref, out) > 20, (g, form)


def test_fp8_grouped_forward_replay_computes_the_recorded_product(bound, scaled_grouped_mm_on_cpu):  # noqa: F811
    g = bound.Gemm("grouped_mm", ((70, 32), (3, 32, 48)), ((32, 1), (1536, 1, 32)), (23, 0, 47))
    args = bound.operands(g, torch.device("cpu"))
    ref = bound.bf16_call(g, args)()
    out = bound.fp8_calls(g, args)["rowwise"]()
    assert out.shape == ref.shape == g.out_shape and sqnr_db(ref, out) > 20


def test_bound_saves_only_where_fp8_is_faster_and_scopes_the_head(bound):
    rows = [
        {"role": "head", "calls": 1, "bf16_ms": 20.0, "saved_ms_per_call": 8.0},
        {"role": "linear", "calls": 4, "bf16_ms": 1.0, "saved_ms_per_call": 0.25},
        {"role": "linear", "calls": 2, "bf16_ms": 0.1, "saved_ms_per_call": 0.0},  # FP8 slower: stays BF16
        {"role": "bmm", "calls": 3, "bf16_ms": 0.5, "saved_ms_per_call": 0.0},  # no FP8 form
    ]
    b = bound.bound(rows, step_bf16_ms=100.0)
    assert b["all"] == {"gemm_bf16_ms": 25.7, "saved_ms": 9.0, "bound_step_ms": 91.0, "max_speedup": round(100 / 91, 4)}
    assert b["no_head"] == {"gemm_bf16_ms": 5.7, "saved_ms": 1.0, "bound_step_ms": 99.0, "max_speedup": round(100 / 99, 4)}
    assert b["gemm_share_of_step"] == 0.257


def test_gemm_rows_keep_a_gemm_fp8_refuses_in_bf16(bound):
    g = bound.Gemm("bmm", ((2, 8, 16), (2, 16, 8)), ((128, 16, 1), (128, 8, 1)))
    rows = bound.gemm_rows({g: 3}, vocab=None, timer=lambda fn: (fn(), 1.0)[1], device=torch.device("cpu"))
    assert rows[0]["fp8_ms"] == {} and rows[0]["saved_ms_per_call"] == 0.0 and rows[0]["calls"] == 3


def test_main_needs_an_fp8_gpu(bound):
    with pytest.raises(SystemExit, match="sm_89 or newer"):
        bound.main(["--device", "cpu", "--flavor", "debug"])


@pytest.mark.gpu
def test_fp8_grouped_replays_on_gpu(bound):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm_90")
    dev = torch.device("cuda")
    groups = (37, 0, 200, 19)  # uneven, one empty, none a multiple of 16
    fwd = bound.Gemm("grouped_mm", ((256, 128), (4, 128, 96)), ((128, 1), (12288, 1, 128)), groups)
    wgrad = bound.Gemm("grouped_mm", ((128, 256), (256, 96)), ((1, 128), (96, 1)), groups)
    for g in (fwd, wgrad):
        args = bound.operands(g, dev)
        ref = bound.bf16_call(g, args)()
        out = bound.fp8_calls(g, args)["rowwise"]()
        assert out.shape == ref.shape == g.out_shape
        rows = sum(groups)
        if g is fwd:
            ref, out = ref[:rows], out[:rows]
        assert sqnr_db(ref.float(), out.float()) > 20, g


def test_measure_records_times_and_bounds_a_step_end_to_end(bound, scaled_mm_on_cpu, tmp_path):  # noqa: F811
    out = tmp_path / "bound.json"
    args = bound.parse_args(["--device", "cpu", "--flavor", "debug", "--layers", "2", "--batch", "2", "--seq", "32",
                             "--steps", "3", "--warmup", "1", "--variants", "eager", "--out", str(out)])
    result = bound.measure(args, timer=lambda fn: (fn(), 1.0)[1])  # every call "takes" 1 ms
    assert [s["name"] for s in result["steps"]] == ["eager"] and result["steps"][0]["status"] == "ok"
    assert result["step_bf16_ms"] == result["steps"][0]["step_ms_median"] and result["vocab"] == 2048
    # equal times: FP8 saves nothing, so the bound is the step itself
    assert result["bound"]["all"]["saved_ms"] == 0 and result["bound"]["all"]["max_speedup"] == 1.0
    assert {r["role"] for r in result["gemms"]} >= {"head", "linear", "grouped"}
    saved = json.loads(out.read_text())
    assert saved["schema"] == bound.SCHEMA and saved["gemms"] == result["gemms"] and "commit" in saved
