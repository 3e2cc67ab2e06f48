"""examples/converge_seeds.py: medians over seeds against the nudged floor, from converge.json files (synthetic
here; tests/unit/harness/test_converge.py runs the real command)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import converge_seeds  # noqa: E402

CONFIG = {"model": "tiny", "batch": 2, "seq": 32, "steps": 8, "lr": 1e-3, "data": "stdlib", "device": "cpu"}


BASE_FINAL, BASE_VAL = 2.0, 2.5


def run(tmp_path, seed, variants, name=None, complete=True, baseline_loss=(3.0, 2.0)):
    """variants: {name: (final gap, val gap)}, signed: the run's losses are BF16's times (1 + gap); the gaps
    converge writes are their magnitudes."""
    def ok(final, val):
        return {"status": "ok", "final_loss_gap_rel": abs(final), "val_loss_gap_rel": abs(val),
                "final_loss": BASE_FINAL * (1 + final), "val_loss": BASE_VAL * (1 + val)}

    doc = {"schema": "moepass.converge/1", "commit": "abc", "complete": complete,
           "config": dict(CONFIG, seed=seed),
           "variants": {"inductor": {"status": "ok", "loss": list(baseline_loss), "final_loss": BASE_FINAL,
                                     "val_loss": BASE_VAL},
                        **{k: ok(*v) if v else {"status": "error"} for k, v in variants.items()}}}
    path = tmp_path / (name or f"seed{seed}.json")
    path.write_text(json.dumps(doc))
    return str(path)


def test_medians_against_the_nudged_medians_and_a_recipe_split_over_two_jobs(tmp_path, capsys):
    floor = {0: (0.010, 0.005), 1: (0.006, 0.004), 2: (0.002, 0.008)}  # medians 0.006, 0.005
    close = {0: (0.001, 0.001), 1: (0.020, 0.002), 2: (0.004, 0.009)}  # medians 0.004, 0.002: within
    far = {0: (0.030, 0.001), 1: (0.009, 0.001), 2: (0.007, 0.001)}  # final median 0.009: outside
    paths = [run(tmp_path, s, {"inductor-nudged": floor[s], "close": close[s]}) for s in range(3)]
    paths += [run(tmp_path, s, {"far": far[s]}, name=f"later{s}.json") for s in range(3)]  # --baseline-from jobs
    out = tmp_path / "seeds.json"
    assert converge_seeds.main([*paths, "--out", str(out)]) == 1  # one recipe does not hold
    summary = json.loads(out.read_text())
    assert summary["seeds"] == [0, 1, 2]
    assert summary["floor"]["final_loss_gap_rel"]["median"] == pytest.approx(0.006)
    assert summary["floor"]["val_loss_gap_rel"]["median"] == pytest.approx(0.005)
    assert summary["variants"]["close"]["final_loss_gap_rel"]["median"] == pytest.approx(0.004)
    assert summary["variants"]["close"]["holds"] is True
    far_final = summary["variants"]["far"]["final_loss_gap_rel"]
    assert far_final["per_seed"] == [0.030, 0.009, 0.007] and far_final["within_floor"] is False
    assert summary["variants"]["far"]["holds"] is False
    assert "far: does not hold" in capsys.readouterr().out


def test_signed_differences_show_when_every_perturbed_run_lands_on_one_side(tmp_path, capsys):
    # seed 1's BF16 run sits above its perturbed runs: nudged and recipe land below it alike
    floor = {0: (0.005, 0.002), 1: (-0.009, -0.001), 2: (-0.002, 0.001)}
    recipe = {0: (0.008, 0.007), 1: (-0.014, -0.007), 2: (-0.004, -0.003)}
    paths = [run(tmp_path, s, {"inductor-nudged": floor[s], "r": recipe[s]}) for s in range(3)]
    summary = converge_seeds.summarize(converge_seeds.load(paths))
    assert summary["signed"]["r"]["final_loss"] == pytest.approx([0.008, -0.014, -0.004])
    assert summary["signed"]["inductor-nudged"]["val_loss"] == pytest.approx([0.002, -0.001, 0.001])
    assert summary["variants"]["r"]["final_loss_gap_rel"]["per_seed"] == pytest.approx([0.008, 0.014, 0.004])
    text = converge_seeds.table(summary)
    assert "-1.40%" in text and "+0.80%" in text and "signed: run - BF16" in text


def test_several_nudged_runs_per_seed_pool_into_one_floor(tmp_path, capsys):
    nudges = {0: ((0.001, 0.001), (0.009, 0.002)), 1: ((0.004, 0.003), (0.002, 0.004)), 2: ((0.012, 0.01),)}
    paths = []
    for s, floors in nudges.items():
        named = {("inductor-nudged" if k == 0 else f"inductor-nudged-{k + 1}"): g for k, g in enumerate(floors)}
        paths.append(run(tmp_path, s, {**named, "r": (0.0035, 0.0025)}))
    summary = converge_seeds.summarize(converge_seeds.load(paths))
    floor = summary["floor"]["final_loss_gap_rel"]
    assert floor["runs_per_seed"] == [2, 2, 1] and sorted(floor["all"]) == [0.001, 0.002, 0.004, 0.009, 0.012]
    assert floor["median"] == pytest.approx(0.004)  # pooled: not the median of the per-seed medians (0.005)
    assert floor["per_seed"] == pytest.approx([0.005, 0.003, 0.012])
    assert summary["variants"]["r"]["final_loss_gap_rel"]["within_floor"] is True
    assert summary["floor"]["val_loss_gap_rel"]["median"] == pytest.approx(0.003)
    assert summary["variants"]["r"]["holds"] is True
    text = converge_seeds.table(summary)
    assert "median of its [2, 2, 1] nudged runs" in text and "nudged BF16 #2" in text


def test_rank_test_against_each_seeds_nudged_gaps(tmp_path):
    # final: r above every nudge of every seed (ranks 4, 4, 4 of 4: p = 1/64); val: below every nudge (p = 1)
    nudges = ((0.002, 0.004), (0.003, 0.005), (0.004, 0.006))
    paths = []
    for s in range(3):
        named = {("inductor-nudged" if k == 0 else f"inductor-nudged-{k + 1}"): g for k, g in enumerate(nudges)}
        paths.append(run(tmp_path, s, {**named, "r": (0.010, 0.001), "tie": (0.003, 0.005)}))
    summary = converge_seeds.summarize(converge_seeds.load(paths))
    final = summary["variants"]["r"]["final_loss_gap_rel"]
    assert final["ranks"] == [4, 4, 4] and final["rank_p"] == pytest.approx(1 / 64)
    assert summary["variants"]["r"]["val_loss_gap_rel"]["rank_p"] == pytest.approx(1.0)
    assert summary["variants"]["tie"]["final_loss_gap_rel"]["ranks"] == [2.5, 2.5, 2.5]  # a tie counts half
    assert "p = 0.02" in converge_seeds.table(summary)


def test_rank_sum_p_is_the_exact_tail_of_independent_uniform_ranks():
    assert converge_seeds.rank_sum_p([2], [1]) == pytest.approx(0.5)  # one nudge: rank 1 or 2
    assert converge_seeds.rank_sum_p([1, 1], [3, 1]) == pytest.approx(1.0)
    # two seeds, 1 and 3 nudges: sums >= 5 of (1..2) + (1..4): (1,4), (2,3), (2,4) of 8
    assert converge_seeds.rank_sum_p([2, 3], [1, 3]) == pytest.approx(3 / 8)


def test_a_failed_seed_never_holds(tmp_path):
    paths = [run(tmp_path, s, {"inductor-nudged": (0.01, 0.01), "r": (0.0, 0.0) if s else None}) for s in range(3)]
    summary = converge_seeds.summarize(converge_seeds.load(paths))
    assert summary["variants"]["r"]["final_loss_gap_rel"]["per_seed"][0] is None
    assert summary["variants"]["r"]["holds"] is False


def test_a_recipe_trained_in_some_seeds_is_judged_over_those(tmp_path):
    # seeds 3 and 4 added later without the old recipe: "-" there, not "failed", and its median over seeds 0-2
    paths = [run(tmp_path, s, {"inductor-nudged": (0.01, 0.01), "new": (0.002, -0.002),
                               **({"old": (0.004 * (s + 1), 0.001)} if s < 3 else {})}) for s in range(5)]
    summary = converge_seeds.summarize(converge_seeds.load(paths))
    old = summary["variants"]["old"]
    assert old["seeds"] == [0, 1, 2] and old["final_loss_gap_rel"]["per_seed"] == pytest.approx([0.004, 0.008, 0.012])
    assert old["final_loss_gap_rel"]["median"] == pytest.approx(0.008) and old["holds"] is True
    assert old["final_loss_gap_rel"]["ranks"] == [1, 1, 2]  # among each of its seeds' nudged gaps only
    assert summary["variants"]["new"]["seeds"] == [0, 1, 2, 3, 4]
    assert summary["signed"]["old"] == {"seeds": [0, 1, 2], "final_loss": pytest.approx([0.004, 0.008, 0.012]),
                                        "val_loss": pytest.approx([0.001] * 3)}
    text = converge_seeds.table(summary)
    old_row = next(line for line in text.splitlines() if line.startswith("old") and "%" in line)
    assert old_row.split()[1:6] == ["0.40%", "0.80%", "1.20%", "-", "-"] and "failed" not in text
    assert "old: holds (median final-loss and val-loss gaps within the nudged medians, over seeds [0, 1, 2] only)" \
        in text


@pytest.mark.parametrize("problem, message", [
    ("cut_off", "cut off before its last variant"),
    ("other_baseline", "different BF16 baselines"),
    ("no_floor", "--nudged-baseline"),
    ("other_config", "differ in more than their seed"),
])
def test_runs_that_cannot_be_compared_are_refused(tmp_path, problem, message):
    paths = [run(tmp_path, 0, {"inductor-nudged": (0.01, 0.01), "r": (0.0, 0.0)})]
    if problem == "cut_off":
        paths.append(run(tmp_path, 1, {"inductor-nudged": (0.01, 0.01)}, complete=False))
    elif problem == "other_baseline":
        paths.append(run(tmp_path, 0, {"s": (0.0, 0.0)}, name="later.json", baseline_loss=(3.0, 2.1)))
    elif problem == "no_floor":
        paths.append(run(tmp_path, 1, {"r": (0.0, 0.0)}))
    else:
        p = run(tmp_path, 1, {"inductor-nudged": (0.01, 0.01), "r": (0.0, 0.0)})
        doc = json.loads(open(p).read())
        doc["config"]["lr"] = 2e-3
        open(p, "w").write(json.dumps(doc))
        paths.append(p)
    with pytest.raises(SystemExit, match=message):
        converge_seeds.load(paths)
