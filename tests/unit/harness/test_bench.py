"""`moepass bench` end to end on CPU (tiny model, few steps); its pieces have their own files beside this one."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import TINY, free_port
from moepass.harness import bench
from moepass.harness.corpus import Batches, load_corpus
from moepass.harness.model_spec import ModelSpec
from moepass.harness.ranks import Ranks
from moepass.harness.timing import add_speedups
from moepass.harness.variants import Variant
from moepass.options import DEFAULT_PASSES

STEPS, WARMUP, BATCH, SEQ = 4, 1, 2, 32
VARIANTS = ["eager", "inductor", "all"]


def _bench_argv(out, *extra):
    return [sys.executable, "-m", "moepass.cli", "bench", "--model-overrides", json.dumps(TINY),
            "--batch", str(BATCH), "--seq", str(SEQ), "--steps", str(STEPS), "--warmup", str(WARMUP),
            "--device", "cpu", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One CLI run shared by the end-to-end checks (each compiled variant costs tens of seconds)."""
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(_bench_argv(out, "--variants", ",".join(VARIANTS), "--profile"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "bench.json") as f:
        return json.load(f), proc.stdout, out


def _positive_finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_json_schema_and_provenance(bench_run):
    result, _, _ = bench_run
    assert result["schema"] == "moepass.bench/1"
    assert result["versions"]["torch"] == torch.__version__
    assert result["versions"]["torchao"] is not None and "deep_ep" in result["versions"]
    assert result["commit"] is None or (len(result["commit"]) == 40 and int(result["commit"], 16) >= 0)
    assert "bench" in result["command"] and "--variants" in result["command"]
    assert result["hardware"]["device"] == "cpu" and result["hardware"]["world_size"] == 1
    assert result["config"]["steps"] == STEPS and result["config"]["model"]["overrides"] == TINY
    assert result["config"]["optimizer"] == "AdamW (torch's default implementation)"  # fused on CUDA only
    assert result["baseline"] == "inductor"
    assert [v["name"] for v in result["variants"]] == VARIANTS and result["complete"] is True


def test_a_run_cut_short_keeps_the_variants_it_measured(tmp_path, monkeypatch):
    """After each variant bench.json holds what is measured so far (complete: false), so a time limit or a
    crash in a later variant does not lose the earlier ones."""
    import argparse

    calls = []

    def fake_run_variant(v, *args, **kwargs):
        if calls:
            raise KeyboardInterrupt  # the run is killed during its second variant
        calls.append(v.name)
        return {"name": v.name, "status": "ok", "step_ms_median": 10.0}

    monkeypatch.setattr(bench, "run_variant", fake_run_variant)
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--model-overrides", json.dumps(TINY), "--variants", "eager,inductor,all",
                         "--steps", "3", "--warmup", "1", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        bench.cmd_bench(args)
    with open(tmp_path / "bench.json") as f:
        partial = json.load(f)
    assert partial["complete"] is False and [v["name"] for v in partial["variants"]] == ["eager"]
    assert partial["variants"][0]["speedup_vs_baseline"] == 1.0 and partial["config"]["steps"] == 3


def test_every_variant_ran_and_numbers_are_sane(bench_run):
    result, _, _ = bench_run
    for v in result["variants"]:
        assert v["status"] == "ok", v.get("error")
        assert len(v["step_ms"]) == STEPS - WARMUP == v["timed_steps"]
        assert all(_positive_finite(t) for t in v["step_ms"])
        for key in ("tokens_per_s_median", "tokens_per_s_min", "tokens_per_s_max", "step_ms_median",
                    "peak_mem_bytes", "first_step_s", "speedup_vs_baseline"):
            assert _positive_finite(v[key]), (v["name"], key, v[key])
        assert v["tokens_per_step"] == BATCH * SEQ
        assert v["tokens_per_s_min"] <= v["tokens_per_s_median"] <= v["tokens_per_s_max"]
        assert v["tokens_per_s_median"] == pytest.approx(BATCH * SEQ / (v["step_ms_median"] / 1e3))
        assert v["step_ms_median"] == pytest.approx(sorted(v["step_ms"])[len(v["step_ms"]) // 2])
        assert all(math.isfinite(x) for x in v["losses"]) and len(v["losses"]) == STEPS


def test_speedups_are_ratios_of_measured_step_times(bench_run):
    result, _, _ = bench_run
    base = next(v for v in result["variants"] if v["name"] == "inductor")
    assert base["speedup_vs_baseline"] == pytest.approx(1.0)
    for v in result["variants"]:
        assert v["speedup_vs_baseline"] == pytest.approx(base["step_ms_median"] / v["step_ms_median"])


def test_compile_time_reported_for_compiled_variants_only(bench_run):
    result, _, _ = bench_run
    by_name = {v["name"]: v for v in result["variants"]}
    assert by_name["eager"]["compile_s"] is None
    for name in ("inductor", "all"):
        v = by_name[name]
        assert _positive_finite(v["compile_s"])
        # compile time is the warm-up step's excess over the median timed step
        assert v["compile_s"] == pytest.approx(v["first_step_s"] - v["step_ms_median"] / 1e3)


def test_variants_start_from_the_same_weights_and_batches(bench_run):
    result, _, _ = bench_run
    first = [v["losses"][0] for v in result["variants"]]
    # BF16 eager vs Inductor vs MXFP8 differ only by rounding on step 0
    assert max(first) - min(first) < 0.02 * first[0]


def test_moepass_variant_reports_what_the_passes_did(bench_run):
    result, _, _ = bench_run
    v = next(v for v in result["variants"] if v["name"] == "all")
    assert v["options"]["passes"] == list(DEFAULT_PASSES)
    assert v["passes"]["grouped_mm"] == 3  # one MoE layer: w1, w3, w2
    assert v["passes"]["linear"] > 0
    assert v["graphs"] == 1 and v["graph_breaks"] == 0


def test_profile_lists_top_kernels(bench_run):
    result, _, _ = bench_run
    for v in result["variants"]:
        rows = v["profile"]
        assert 0 < len(rows) <= 25  # profile_table's top
        assert all(r["name"] and r["calls"] > 0 and r["self_us"] > 0 for r in rows)
        assert [r["self_us"] for r in rows] == sorted((r["self_us"] for r in rows), reverse=True)


def test_terminal_shows_progress_table_and_files(bench_run):
    result, stdout, out = bench_run
    assert re.search(r"^  inductor +step +1/6 ", stdout, re.M)  # 4 steps + 2 profiled
    assert "tokens/s median" in stdout and "speedup" in stdout
    for v in result["variants"]:
        assert f"{v['speedup_vs_baseline']:.2f}x" in stdout
    assert f"wrote {out / 'bench.json'}" in stdout
    png = out / "bench.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "PNG skipped" in stdout and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- one variant, user model and text


def tiny_lm(vocab_size=256, dim=32):
    """A user model for --model MODULE:FACTORY: embedding, one linear, output head."""
    return torch.nn.Sequential(torch.nn.Embedding(vocab_size, dim), torch.nn.Linear(dim, dim),
                               torch.nn.ReLU(), torch.nn.Linear(dim, vocab_size))


def test_failed_variant_is_reported_and_the_others_run(tmp_path, capsys):
    """A user factory model on user text; a variant whose backend does not exist fails alone."""
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    train_tokens, _ = load_corpus(str(text))
    batches = Batches(train_tokens, 2, 16)
    spec = ModelSpec(overrides={"dim": 64}, factory=f"{__name__}:tiny_lm")
    ranks = Ranks()
    entries = [bench.run_variant(v, spec, batches, steps=3, warmup=1, lr=1e-3, seed=0, ranks=ranks, ep=1)
               for v in (Variant("broken", "no_such_backend"), Variant("eager", None))]
    broken, eager = entries
    assert broken["status"] == "failed" and "no_such_backend" in broken["error"]
    assert eager["status"] == "ok" and _positive_finite(eager["tokens_per_s_median"])
    assert add_speedups(entries) == "eager"
    assert "broken" in bench.table(entries, 1) and "FAILED" in bench.table(entries, 1)


@pytest.mark.extended  # ~90 s on 2 cores; CI's EP coverage is tests/integration/test_model_ep.py and the torchtitan tests
def test_torchrun_two_cpu_ranks_expert_parallel(tmp_path):
    """2 gloo ranks, experts split over them (--ep 2): rank 0 writes totals and per-rank tokens/s."""
    bench_argv = _bench_argv(tmp_path, "--variants", "eager,mxfp8_grouped_mm", "--ep", "2")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), *bench_argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["hardware"]["world_size"] == 2 and result["config"]["ep"] == 2
    assert proc.stdout.count("tokens/s median") == 1  # only rank 0 reports
    for v in result["variants"]:
        assert v["status"] == "ok", v.get("error")
        assert v["tokens_per_step"] == 2 * BATCH * SEQ
        assert v["tokens_per_s_per_device_median"] == pytest.approx(v["tokens_per_s_median"] / 2)
        assert _positive_finite(v["speedup_vs_baseline"])
    full = sum(p.numel() for p in ModelSpec(overrides=TINY).build(0, torch.device("cpu")).parameters())
    experts = 3 * 8 * TINY["moe_inter_dim"] * TINY["dim"]  # w1, w2, w3 of the 8 routed experts, one MoE layer
    assert all(v["parameters"] == full - experts // 2 for v in result["variants"])  # each rank holds half
    moe = next(v for v in result["variants"] if v["name"] == "mxfp8_grouped_mm")
    assert moe["passes"]["grouped_mm"] == 3 and moe["graph_breaks"] == 0

