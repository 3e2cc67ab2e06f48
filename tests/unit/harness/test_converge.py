"""`moepass converge` end to end on CPU (tiny model, few steps); the loss-gap arithmetic is in test_parity.py."""

import json
import math
import re
import subprocess
import sys

import pytest

from helpers import TINY
from moepass.harness import converge
from moepass.harness.parity import loss_gaps
from moepass.options import DEFAULT_PASSES

STEPS, WINDOW, TOLERANCE = 8, 3, 0.05
# the moepass variant runs its rewritten graph eagerly: the judging checked here does not depend on Inductor compiling
# it (an Inductor compile of its own, ~15 s on 2 cores), and test_bench.py trains the default moepass variant through
# Inductor; the baseline and its floors stay Inductor's (the CLI's fixed baseline)
MOEPASS_OPTIONS = {"inductor": False}


@pytest.fixture(scope="module")
def converge_run(tmp_path_factory):
    """One CLI run (BF16 Inductor vs all moepass passes) on the default data: the stdlib's source."""
    out = tmp_path_factory.mktemp("converge")
    argv = [sys.executable, "-m", "moepass.cli", "converge", "--model-overrides", json.dumps(TINY),
            "--batch", "2", "--seq", "32", "--steps", str(STEPS), "--window", str(WINDOW),
            "--val-batches", "2", "--tolerance", str(TOLERANCE), "--device", "cpu", "--repeat-baseline", "--nudged-baseline",
            "--options", json.dumps(MOEPASS_OPTIONS), "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "converge.json") as f:
        return json.load(f), proc, out


def test_json_schema(converge_run):
    result, _, _ = converge_run
    assert result["schema"] == "moepass.converge/1"
    assert set(result["variants"]) == {"inductor", "moepass", "inductor-rerun", "inductor-nudged"}
    assert result["baseline"] == "inductor" and result["window"] == WINDOW and result["tolerance"] == TOLERANCE
    assert result["config"]["data"] == "stdlib" and result["config"]["steps"] == STEPS
    assert result["config"]["optimizer"].startswith("AdamW")
    for key in ("hardware", "versions", "commit", "command"):
        assert key in result
    assert result["variants"]["moepass"]["options"] == {**MOEPASS_OPTIONS, "passes": list(DEFAULT_PASSES)}
    assert result["variants"]["inductor"]["backend"] == "inductor" and result["variants"]["inductor"]["options"] is None


def test_curves_are_sane_and_start_from_the_same_model(converge_run):
    result, _, _ = converge_run
    curves = {n: v["loss"] for n, v in result["variants"].items()}
    for name, v in result["variants"].items():
        assert v["status"] == "ok", v.get("error")
        assert len(v["loss"]) == STEPS and all(math.isfinite(x) and x > 0 for x in v["loss"])
        assert math.isfinite(v["val_loss"]) and v["val_loss"] > 0
        assert v["final_loss"] == pytest.approx(sum(v["loss"][-WINDOW:]) / WINDOW)
    # same weights and same first batch: only MXFP8 rounding separates step 0
    assert curves["moepass"][0] == pytest.approx(curves["inductor"][0], rel=0.01)
    # the byte-level model learns something in a few steps
    assert min(curves["inductor"][-WINDOW:]) < curves["inductor"][0]


def test_gaps_recomputed_from_the_curves(converge_run):
    result, _, _ = converge_run
    base, cand = result["variants"]["inductor"]["loss"], result["variants"]["moepass"]["loss"]
    windows = [(sum(cand[i:i + WINDOW]) / WINDOW, sum(base[i:i + WINDOW]) / WINDOW)
               for i in range(STEPS - WINDOW + 1)]
    gaps = [abs(c - b) / b for c, b in windows]
    assert result["final_loss_gap_rel"] == pytest.approx(gaps[-1])
    assert result["max_window_gap_rel"] == pytest.approx(max(gaps))
    assert result["variants"]["moepass"]["final_loss_gap_rel"] == pytest.approx(gaps[-1])


def test_repeated_baseline_measures_the_noise_floor(converge_run):
    result, proc, _ = converge_run
    base, rerun = result["variants"]["inductor"], result["variants"]["inductor-rerun"]
    # CPU Inductor is deterministic: the rerun repeats the baseline exactly, so the floor is 0
    assert rerun["loss"] == base["loss"] and result["noise_floor_gap_rel"] == 0.0
    assert "against its own rerun: 0.000%" in proc.stdout
    assert "pass" not in rerun  # the rerun never decides the verdict


def test_nudged_baseline_measures_how_far_an_insignificant_change_drifts(converge_run):
    result, proc, _ = converge_run
    base, nudged = result["variants"]["inductor"], result["variants"]["inductor-nudged"]
    assert nudged["loss"] != base["loss"]  # the weights moved, so the curve does
    assert nudged["loss"][0] == pytest.approx(base["loss"][0], rel=0.01)  # but by a rounding's worth
    gaps = loss_gaps(base["loss"], nudged["loss"], WINDOW)
    assert gaps["final_loss_gap_rel"] > 0 and result["nudged_floor_gap_rel"] == pytest.approx(gaps["final_loss_gap_rel"])
    assert f"itself from weights nudged by an ulp: {gaps['final_loss_gap_rel'] * 100:.3f}%" in proc.stdout
    assert "pass" not in nudged  # a floor never decides the verdict


def test_nudge_moves_every_float_weight_by_one_or_two_bf16_ulps_reproducibly():
    import torch

    def nudged(seed):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Embedding(10, 8)).to(torch.bfloat16)
        before = [p.detach().clone() for p in m.parameters()]
        converge.nudge_weights(m, seed)
        return before, [p.detach().clone() for p in m.parameters()]

    before, after = nudged(1)
    for b, a in zip(before, after):
        nonzero = b != 0
        rel = ((a.float() - b.float()) / b.float())[nonzero].abs()
        assert (a[nonzero] != b[nonzero]).all() and rel.max() <= 2 * 2.0**-7 and rel.min() >= 2.0**-9
    assert all(torch.equal(x, y) for x, y in zip(after, nudged(1)[1]))
    assert not all(torch.equal(x, y) for x, y in zip(after, nudged(2)[1]))


def test_verdict_matches_tolerance_and_exit_code(converge_run):
    result, proc, _ = converge_run
    assert result["pass"] == (result["final_loss_gap_rel"] <= TOLERANCE)
    assert proc.returncode == (0 if result["pass"] else 1)
    line = re.search(r"^(PASS|FAIL): final-loss gap ([\d.]+)%", proc.stdout, re.M)
    assert line and line.group(1) == ("PASS" if result["pass"] else "FAIL")
    assert float(line.group(2)) == pytest.approx(100 * result["final_loss_gap_rel"], abs=1e-3)


def test_progress_and_plot(converge_run):
    _, proc, out = converge_run
    assert re.search(r"moepass +step +8/8 +loss", proc.stdout)
    png = out / "converge.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "PNG skipped" in proc.stdout and not png.exists()
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_chart_reads_past_the_first_steps_and_keeps_each_variants_colour():
    plt = pytest.importorskip("matplotlib.pyplot")
    from moepass.harness.plot import loss_figure

    steps = 200
    falling = [12.0 * 0.5**i + 1.3 + 0.01 * (i % 7) for i in range(steps)]  # 12 -> 1.3 in a few steps, then noise
    result = {"window": 10, "baseline": "inductor", "tolerance": 0.01, "variants": {
        "inductor": {"loss": falling}, "moepass": {"loss": [v * 1.002 for v in falling]},
        "inductor-nudged": {"loss": [v * 0.999 for v in falling]}}}
    fig = loss_figure(result, plt)
    top, bottom = fig.axes
    low, high = top.get_ylim()
    assert high < 2.0 and low > 1.0, (low, high)  # the settled losses fill the panel; 12 is off the top
    top_colour = {line.get_label(): line.get_color() for line in top.get_lines() if not line.get_label().startswith("_")}
    gap_colour = {line.get_label(): line.get_color() for line in bottom.get_lines() if line.get_label() != "tolerance"}
    assert gap_colour == {name: top_colour[name] for name in ("moepass", "inductor-nudged")}
    plt.close(fig)


def test_a_later_job_judges_a_recipe_against_the_baseline_already_trained(converge_run, tmp_path, capsys):
    """--baseline-from: the BF16 runs (and floors) come from the earlier converge.json, only the recipe trains."""
    from moepass.cli import main

    earlier, _, earlier_out = converge_run
    # the variant: BF16 in eager (no compile, a few seconds); what is tested is where the baseline comes from, so the
    # CLI runs in this process (its parser and command as `moepass converge` runs them, without a second interpreter)
    code = main(["converge", "--model-overrides", json.dumps(TINY), "--batch", "2", "--seq", "32", "--steps", str(STEPS),
                 "--window", str(WINDOW), "--val-batches", "2", "--tolerance", str(TOLERANCE), "--device", "cpu",
                 "--out", str(tmp_path), "--variants", "eager", "--baseline-from", str(earlier_out / "converge.json")])
    stdout = capsys.readouterr().out
    assert code in (0, 1), stdout[-3000:]
    result = json.loads((tmp_path / "converge.json").read_text())
    assert stdout.count("from " + str(earlier_out)) == 3  # baseline, rerun and nudged floors: not trained
    for name in ("inductor", "inductor-rerun", "inductor-nudged"):
        assert result["variants"][name]["loss"] == earlier["variants"][name]["loss"]
    assert result["nudged_floor_gap_rel"] == pytest.approx(earlier["nudged_floor_gap_rel"])
    eager = result["variants"]["eager"]
    assert eager["loss"] != earlier["variants"]["inductor"]["loss"]  # trained here (eager rounds differently)
    gaps = loss_gaps(earlier["variants"]["inductor"]["loss"], eager["loss"], WINDOW)
    assert eager["final_loss_gap_rel"] == pytest.approx(gaps["final_loss_gap_rel"])
    assert result["complete"] is True and result["baseline_from"]["runs"] == sorted(
        ["inductor", "inductor-rerun", "inductor-nudged"])


def test_a_baseline_trained_differently_is_refused(converge_run, tmp_path):
    earlier, _, earlier_out = converge_run
    config = dict(earlier["config"], seed=1, lr=0.5, device="cuda:0")
    with pytest.raises(SystemExit, match="was trained differently") as e:
        converge.earlier_baseline(str(earlier_out / "converge.json"), config)
    assert "seed 0 there, 1 here" in str(e.value) and "lr " in str(e.value) and "device 'cpu' there, 'cuda' here" \
        in str(e.value)
    assert converge.earlier_baseline(str(earlier_out / "converge.json"), dict(earlier["config"]))  # the same: taken
    (tmp_path / "bench.json").write_text(json.dumps({"schema": "moepass.bench/1", "variants": {}}))
    with pytest.raises(SystemExit, match="not a moepass.converge/1 result"):
        converge.earlier_baseline(str(tmp_path / "bench.json"), config)
    with pytest.raises(SystemExit, match="cannot read it"):
        converge.earlier_baseline(str(earlier_out / "converge.png"), config)


def test_a_job_cut_off_keeps_what_finished_and_its_baseline_can_be_reused(tmp_path, monkeypatch):
    """The baseline and its floor train first and are on disk before the recipes: a job killed at its time limit
    leaves them for --baseline-from (the emulated-MXFP8 run alone can outlast a device job)."""
    import argparse

    trained = []

    def train_variant(v, *args, **kwargs):
        if len(trained) == 2:
            raise KeyboardInterrupt  # the job's time limit, during the recipe
        trained.append(v.name)
        return {"status": "ok", "loss": [3.0, 2.0 + len(trained)], "val_loss": 2.0}

    monkeypatch.setattr(converge, "train_variant", train_variant)
    p = argparse.ArgumentParser()
    converge.add_arguments(p)
    args = p.parse_args(["--model-overrides", json.dumps(TINY), "--device", "cpu", "--nudged-baseline",
                         "--variants", "linear", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt):
        converge.cmd_converge(args)
    assert trained == ["inductor", "inductor-nudged"]
    partial = json.loads((tmp_path / "converge.json").read_text())
    assert partial["complete"] is False and list(partial["variants"]) == trained
    config = dict(partial["config"])
    assert set(converge.earlier_baseline(str(tmp_path / "converge.json"), config)) == set(trained)


def test_several_nudged_floors_each_with_its_own_signs_and_reused_by_a_later_job(tmp_path, monkeypatch):
    """--nudged-baseline N: N nudged runs (the first as before, seed + 1), each gap in the verdict; a later job's
    --baseline-from takes them all."""
    import argparse

    trained = {}

    def train_variant(v, *args, nudge=None, **kwargs):
        trained[v.name] = nudge
        k = len(trained)
        return {"status": "ok", "loss": [3.0, 2.0 + 0.01 * k], "val_loss": 2.0 + 0.01 * k}

    def run(*argv):
        p = argparse.ArgumentParser()
        converge.add_arguments(p)
        return converge.cmd_converge(p.parse_args(["--model-overrides", json.dumps(TINY), "--device", "cpu",
                                                   "--seed", "5", *argv]))

    monkeypatch.setattr(converge, "train_variant", train_variant)
    run("--nudged-baseline", "3", "--variants", "linear", "--out", str(tmp_path / "a"))
    assert list(trained) == ["inductor", "inductor-nudged", "inductor-nudged-2", "inductor-nudged-3", "linear"]
    seeds = [trained[n] for n in ("inductor-nudged", "inductor-nudged-2", "inductor-nudged-3")]
    assert seeds[0] == 6 and len(set(seeds)) == 3 and trained["inductor"] is None and trained["linear"] is None
    result = json.loads((tmp_path / "a" / "converge.json").read_text())
    floors = result["nudged_floor_gaps_rel"]
    assert list(floors) == ["inductor-nudged", "inductor-nudged-2", "inductor-nudged-3"]
    assert floors["inductor-nudged-2"] == pytest.approx(0.01 / 2.505)  # final = mean of both steps: 2.515 vs 2.505
    assert result["nudged_floor_gap_rel"] == floors["inductor-nudged"]

    trained.clear()
    run("--nudged-baseline", "--variants", "eager", "--out", str(tmp_path / "b"),
        "--baseline-from", str(tmp_path / "a" / "converge.json"))
    assert list(trained) == ["eager"]  # the baseline and its three floors came from the earlier job
    later = json.loads((tmp_path / "b" / "converge.json").read_text())
    assert later["nudged_floor_gaps_rel"] == pytest.approx(floors)
    with pytest.raises(SystemExit, match="N >= 1"):
        run("--nudged-baseline", "-1", "--variants", "linear", "--out", str(tmp_path / "c"))
