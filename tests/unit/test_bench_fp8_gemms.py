"""examples/bench_fp8_gemms.py without a GPU: its shape lists, summaries, threshold suggestion, and one linear
row built on CPU (torch._scaled_mm's CPU kernel, a CPU timer, aot_eager with moepass's decompositions)."""

from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from moepass.ops.lowp.fp8_rowwise import decomp
from helpers import scaled_grouped_mm_on_cpu, scaled_mm_on_cpu  # noqa: F401  (fixtures)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    path = os.path.join(REPO, "examples", "bench_fp8_gemms.py")
    spec = importlib.util.spec_from_file_location("bench_fp8_gemms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_shapes_are_few_aligned_and_filterable(bench):
    linears, grouped = bench.shape_lists(bench.parse_args([]))
    assert len(linears) == 12 and len(grouped) == 4  # what fits in ~2 minutes of compiles on an H200 host
    assert all(k % 16 == 0 and n % 16 == 0 for *_, k, n in linears + grouped)
    linears, grouped = bench.shape_lists(bench.parse_args(["--models", "16B", "--no-grouped"]))
    assert {s[0] for s in linears} == {"16B"} and grouped == []
    more, _ = bench.shape_lists(bench.parse_args(["--more-shapes"]))
    assert len(more) == len(bench.LINEARS) + len(bench.MORE_LINEARS)
    assert not bench.parse_args([]).sweep and bench.parse_args(["--sweep"]).sweep


def test_jobs_run_16b_first_and_the_sweep_only_on_request(bench):
    args = bench.parse_args([])
    kinds = [(kind, shape[0]) for kind, shape in bench.jobs(args)]
    assert kinds[:8] == [("linear", "16B")] * 6 + [("grouped", "16B")] * 2 and len(kinds) == 16
    assert args.budget_s == 90.0  # the default run stays within ~2 minutes
    sweep = bench.parse_args(["--sweep", "--models", "671B"])
    kinds = [kind for kind, _ in bench.jobs(sweep)]
    assert sweep.budget_s == 0 and kinds.count("linear_sweep") == 12 and kinds.count("grouped_sweep") == 6
    assert kinds.count("linear") == 6 and kinds.count("grouped") == 2


def test_summary_and_suggested_min_shape(bench):
    def row(k, n, tokens, fp8_ms):
        return {"K": k, "N": n, "tokens": tokens, **bench.summarize(
            {"fwd": 1.0, "dgrad": 1.0, "wgrad": 1.0}, {"fwd": fp8_ms, "dgrad": fp8_ms, "wgrad": fp8_ms}, 1e9)}

    rows = [row(512, 512, 1024, 1.5), row(2048, 2048, 16384, 0.6), row(4096, 4096, 16384, 0.5)]
    assert rows[1]["speedup"]["fwd+bwd"] == pytest.approx(1 / 0.6, abs=1e-3)
    assert rows[1]["saved_ms"] == pytest.approx(1.2)
    best = bench.suggest_min_shape(rows, "tokens")
    assert best["gemms_to_fp8"] == 2 and best["saved_ms"] == pytest.approx(1.2 + 1.5)  # both faster GEMMs
    assert not (512 >= best["k"] and 512 >= best["n"] and 1024 >= best["tokens"])  # and not the slower one
    assert bench.suggest_min_shape(rows[:1], "tokens")["k"] is None  # slower everywhere: say so
    assert bench.suggestions({"linear": [], "linear_sweep": [], "grouped": [], "grouped_sweep": []}) == \
        {"linear": None, "grouped": None}


def test_grouped_reference_is_per_group_fp32(bench):
    sizes = [3, 0, 5]
    x, g = torch.randn(8, 32).to(torch.bfloat16), torch.randn(8, 16).to(torch.bfloat16)
    w_t = torch.randn(3, 32, 16).to(torch.bfloat16)
    ref = bench.grouped_reference(x, w_t, g, sizes)
    torch.testing.assert_close(ref["fwd"][3:], x[3:].float() @ w_t[2].float())
    torch.testing.assert_close(ref["wgrad"][0], x[:3].float().t() @ g[:3].float())
    assert not ref["wgrad"][1].any() and sum(bench.routed_group_sizes(8, 1000, seed=0)) == 1000


def test_linear_row_on_cpu(bench, scaled_mm_on_cpu, monkeypatch):  # noqa: F811
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "compiled", _cpu_compiled)
    monkeypatch.setattr(bench, "time_ms", _cpu_time_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    args = bench.parse_args(["--iters", "1", "--warmup", "0", "--train-step"])
    row = bench.bench_linear(40, 64, 48, args, extras=True)  # 40 tokens: padded to 48 inside
    assert row["bitwise_equal_to_eager_op"] == {"fwd": True, "dgrad": True, "wgrad": True}
    assert set(row["fp8_gemm_ms"]) == {"fwd", "dgrad", "wgrad", "fwd_no_fast_accum", "dgrad_no_fast_accum",
                                       "wgrad_no_fast_accum"}
    assert all(v > 20 for v in row["sqnr_db"].values()), row["sqnr_db"]
    assert row["speedup"]["fwd+bwd"] > 0 and row["train_step"]["fp8_rowwise_ms"] > 0
    assert row["auto_recipe"] and "blockwise" not in row  # opt-in
    print(bench.format_row("16B", "test", "M=40", row))


def test_auto_table_on_cpu_writes_a_table_that_loads(bench, scaled_grouped_mm_on_cpu, monkeypatch, tmp_path):  # noqa: F811
    """--auto-table end to end on CPU: one linear at two token counts and one expert MLP at two loads."""
    from moepass.recipes import auto_table

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "compiled", _cpu_compiled)
    monkeypatch.setattr(bench, "time_ms", _cpu_time_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "CPU standing in")
    monkeypatch.setattr(bench, "LINEARS", [("16B", "attention.wq", 64, 48)])
    monkeypatch.setattr(bench, "MORE_LINEARS", [])
    monkeypatch.setattr(bench, "AUTO_MLPS", [("16B", 64, 32)])
    _received_rows_decomposed_on_cpu(monkeypatch)
    out = tmp_path / "table.json"
    args = bench.parse_args(["--auto-table", "--iters", "1", "--warmup", "0", "--out", str(out),
                             "--tokens-list", "32,64", "--tokens-per-expert-list", "16,32"])
    assert bench.auto_table(args) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == auto_table.SCHEMA and data["capability"] == [9, 0]
    assert [(r["K"], r["N"], r["tokens"]) for r in data["linear"]] == [(64, 48, 32), (64, 48, 64)]
    assert [(r["dim"], r["inter"], r["tokens_per_expert"]) for r in data["grouped"]] == [(64, 32, 16), (64, 32, 32)]
    assert [r["tokens_per_expert"] for r in data["grouped_received"]] == [16, 32]  # the same MLPs on received rows
    for r in data["linear"] + data["grouped"] + data["grouped_received"]:
        assert r["speedup"] == pytest.approx(r["bf16_ms"] / r["fp8_ms"], rel=0.02, abs=2e-3)  # both rounded
    table = auto_table.AutoTable(data, str(out))
    assert table.linear(64, 48, 64).speedup == data["linear"][1]["speedup"]
    assert table.grouped(32, 64, 32).speedup == data["grouped"][1]["speedup"]  # w2 of the MLP
    assert table.grouped(32, 64, 32, received=True).speedup == data["grouped_received"][1]["speedup"]


def test_received_rows_on_cpu_times_static_and_data_dependent_rows_alike(bench, scaled_grouped_mm_on_cpu,  # noqa: F811
                                                                          monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "compiled", _cpu_compiled)
    monkeypatch.setattr(bench, "time_ms", _cpu_time_ms)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "CPU standing in")
    monkeypatch.setattr(bench, "AUTO_MLPS", [("16B", 64, 32)])
    _received_rows_decomposed_on_cpu(monkeypatch)
    out = tmp_path / "received.json"
    args = bench.parse_args(["--received-rows", "--iters", "1", "--warmup", "0", "--out", str(out),
                             "--tokens-per-expert-list", "16"])
    assert args.received_rows and bench.received_rows(args) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["static"]["tokens_per_expert"] == row["received"]["tokens_per_expert"] == 16
    for r in (row["static"], row["received"]):
        assert r["speedup"] == pytest.approx(r["bf16_ms"] / r["fp8_ms"], rel=0.02, abs=2e-3)


def test_received_expert_mlp_computes_what_the_static_one_does(bench, scaled_grouped_mm_on_cpu,  # noqa: F811
                                                              monkeypatch):
    _received_rows_decomposed_on_cpu(monkeypatch)
    torch.manual_seed(1)
    hidden, idx = torch.randn(6, 64).bfloat16(), torch.tensor([0, 3, 5, 1, 1, 2, 4, 0])
    w1, w3, w2 = (torch.randn(2, 32, 64) / 8).bfloat16(), (torch.randn(2, 32, 64) / 8).bfloat16(), \
        (torch.randn(2, 64, 32) / 6).bfloat16()
    offs = torch.tensor([3, 8], dtype=torch.int32)
    for fp8 in (False, True):
        static = _cpu_compiled(bench.expert_mlp(fp8), False)(hidden, idx, w1, w3, w2, offs)
        received = _cpu_compiled(bench.expert_mlp(fp8, received=True), False)(hidden, idx, w1, w3, w2, offs)
        assert torch.equal(static, received), fp8


def test_expert_mlp_bf16_is_the_routed_swiglu(bench):
    torch.manual_seed(0)
    hidden, idx = torch.randn(6, 16), torch.tensor([0, 3, 5, 1, 1, 2, 4, 0])
    w1, w3, w2 = torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 16, 8)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    out = bench.expert_mlp(fp8=False)(hidden.bfloat16(), idx, w1.bfloat16(), w3.bfloat16(), w2.bfloat16(), offs)
    x = hidden.bfloat16().float()[idx]
    for e, rows in enumerate((slice(0, 3), slice(3, 8))):
        h = torch.nn.functional.silu(x[rows] @ w1[e].bfloat16().float().t()) * (x[rows] @ w3[e].bfloat16().float().t())
        torch.testing.assert_close(out[rows].float(), h @ w2[e].bfloat16().float().t(), rtol=0.05, atol=0.3)


def _received_rows_decomposed_on_cpu(monkeypatch):
    """On received rows the op stays opaque, and its eager kernels are torchao's Triton ones (no CPU build): here
    those rows decompose like static ones, which checks the plumbing and the arithmetic, not the path."""
    monkeypatch.setattr(decomp, "_maybe_empty", lambda m: False)


def _cpu_compiled(fn, autotune):  # aot_eager with moepass's decompositions: the compiled path, on CPU
    return torch.compile(fn, backend=aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                                                  decompositions=decomp.fp8_rowwise_decompositions()),
                         dynamic=False, fullgraph=True)


def _cpu_time_ms(fn, warmup, iters):  # one call, wall clock: the rows' arithmetic, not a speed
    began = time.perf_counter()
    fn()
    return (time.perf_counter() - began) * 1e3
