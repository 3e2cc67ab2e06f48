"""Numerics over seeds: medians of `moepass converge` runs, each recipe against the nudged-BF16 floor.

One `moepass converge --nudged-baseline` run per seed (the same command with --seed 0, 1, 2, ...) gives, per
variant, its final-loss gap and validation-loss gap to the BF16 baseline, and the same two gaps for the baseline
retrained from weights nudged by an ulp: how far this model and lr amplify a numerically insignificant change.
One seed proves nothing either way (a nudge alone moves the final loss by 0.2-2% here), so a recipe is judged on
medians over seeds: it holds when the median of its gaps is within the median of the nudged gaps, for the final
training loss and for the validation loss alike. A seed may hold several nudged runs (`--nudged-baseline N`): the
floor's median is then taken over all of them, every seed's pooled. The signed differences (run - BF16) are
printed too: where the nudged runs and the recipes of a seed land on one side of its BF16 run, the gaps of that
seed measure that BF16 run's own place as much as any recipe.

The median criterion compares two noisy numbers: a run that perturbs training no more than a nudge fails it about
half the time. So a rank test is printed beside it (it does not change the verdict): in each seed, the recipe's gap
ranks among that seed's nudged gaps (1 = smallest of n + 1); if the recipe were just another nudge, each rank
would be uniform and independent across seeds, which gives the chance `p` of a rank sum at least as high. A small
p says the recipe moves training more than a nudge does; a large one says these seeds cannot tell them apart.

    python examples/converge_seeds.py RUN_DIR [RUN_DIR ...] [--out seeds.json]

RUN_DIR: a converge --out directory (holding converge.json); every run must share the config except its seed.
One seed may span several runs: recipes trained in later jobs with `--baseline-from` the first run's
converge.json (a 1,500-step emulated-MXFP8 run alone can outlast a job's time limit). A recipe trained in some
seeds only (one added later, one retired) is judged over those seeds, and the table shows "-" for the others; a
run that failed shows "failed" and never holds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from collections import defaultdict

from moepass.harness.converge import BASELINE, RERUN, is_nudged, nudged_index

GAPS = (("final_loss_gap_rel", "final-loss gap"), ("val_loss_gap_rel", "val-loss gap"))
SIGNED = (("final_loss", "final"), ("val_loss", "val"))


def is_floor(name: str) -> bool:
    """The BF16 runs (baseline, rerun, nudged floors): not recipes."""
    return name in (BASELINE, RERUN) or is_nudged(name)


def load(paths: list[str]) -> list[dict]:
    """One merged run per seed. A seed may span several files: recipes trained in separate jobs with
    `--baseline-from` against the same baseline (its nudged floor in any of them)."""
    by_seed: dict[int, dict] = {}
    for d in paths:
        path = pathlib.Path(d) / "converge.json" if pathlib.Path(d).is_dir() else pathlib.Path(d)
        run = json.loads(path.read_text())
        if not run.get("complete", True):  # files before `complete` was written are whole runs
            raise SystemExit(f"{path}: the job was cut off before its last variant (no gaps yet); train the rest "
                             f"with `moepass converge ... --baseline-from {path}`")
        seed = run["config"]["seed"]
        if seed not in by_seed:
            by_seed[seed] = dict(run, paths=[str(path)], commits=[run.get("commit")])
            continue
        merged = by_seed[seed]
        if run["variants"][BASELINE]["loss"] != merged["variants"][BASELINE]["loss"]:
            raise SystemExit(f"{path} and {merged['paths']} (seed {seed}) were judged against different BF16 "
                             "baselines; train the later recipes with --baseline-from the first run's converge.json")
        twice = sorted(n for n in set(run["variants"]) & set(merged["variants"]) if not is_floor(n))
        if twice:
            raise SystemExit(f"seed {seed}: {twice} trained in both {path} and {merged['paths']}; give one")
        merged["variants"] = {**run["variants"], **merged["variants"]}
        merged["paths"].append(str(path))
        merged["commits"].append(run.get("commit"))
    runs = list(by_seed.values())
    for run in runs:
        if not nudged_runs(run):
            raise SystemExit(f"{run['paths']}: no nudged BF16 run; rerun `moepass converge` with --nudged-baseline")
    differ = {k for r in runs for k in r["config"] if k != "seed" and r["config"][k] != runs[0]["config"][k]}
    if differ:
        raise SystemExit(f"the runs differ in more than their seed: {sorted(differ)}")
    return sorted(runs, key=lambda r: r["config"]["seed"])


def gap(run: dict, variant: str, key: str) -> float | None:
    """A variant's gap in one seed's run; None when it failed there (a failed run never counts as holding)."""
    v = run["variants"].get(variant)
    return None if v is None or v.get("status") != "ok" else v.get(key)


def nudged_runs(run: dict) -> list[str]:
    return sorted((n for n in run["variants"] if is_nudged(n)), key=nudged_index)


def signed(run: dict, variant: str, key: str) -> float | None:
    """(variant - BF16) / BF16 of `key` ("final_loss" or "val_loss") in one seed's run, with its sign."""
    v, base = run["variants"].get(variant), run["variants"][BASELINE]
    return None if v is None or v.get("status") != "ok" else (v[key] - base[key]) / base[key]


def rank_among(g: float, floor: list[float]) -> float:
    """1-based rank of a gap among its seed's nudged gaps and itself; a tie counts half."""
    return 1 + sum(f < g for f in floor) + 0.5 * sum(f == g for f in floor)


def rank_sum_p(ranks: list[float], floor_sizes: list[int]) -> float:
    """P(sum of ranks >= observed) when each seed's rank is uniform on 1..n+1 (n: its nudged runs), independently."""
    dist = {0: 1.0}
    for n in floor_sizes:
        step = defaultdict(float)
        for total, p in dist.items():
            for r in range(1, n + 2):
                step[total + r] += p / (n + 1)
        dist = step
    observed = sum(ranks)
    return sum(p for total, p in dist.items() if total >= observed - 1e-9)


def summarize(runs: list[dict]) -> dict:
    variants = list(dict.fromkeys(n for r in runs for n in r["variants"] if not is_floor(n)))
    out = {"seeds": [r["config"]["seed"] for r in runs], "config": {k: v for k, v in runs[0]["config"].items()
                                                                    if k != "seed"},
           "runs": [r["paths"] for r in runs], "commits": sorted({str(c) for r in runs for c in r["commits"]}),
           "floor": {}, "variants": {}}
    # each seed's nudged gaps, per gap kind: pooled into the floor, and each recipe's rank test reads its seed's
    floors = {key: [[gap(r, n, key) for n in nudged_runs(r)] for r in runs] for key, _ in GAPS}
    for key, _ in GAPS:  # every nudged run of every seed: one pooled sample of the floor
        per_seed = floors[key]
        pooled = [g for gaps in per_seed for g in gaps]
        out["floor"][key] = {
            "per_seed": [None if None in gaps else statistics.median(gaps) for gaps in per_seed],
            "runs_per_seed": [len(gaps) for gaps in per_seed], "all": pooled,
            "median": None if None in pooled else statistics.median(pooled)}
    for name in variants:
        # a recipe is judged over the seeds it was trained in (a later job may add it to some seeds only)
        trained = [i for i, r in enumerate(runs) if name in r["variants"]]
        entry = {"seeds": [runs[i]["config"]["seed"] for i in trained]}
        for key, _ in GAPS:
            per_seed = [gap(runs[i], name, key) for i in trained]
            med = None if None in per_seed else statistics.median(per_seed)
            floor = out["floor"][key]["median"]
            entry[key] = {"per_seed": per_seed, "median": med,
                          "within_floor": med is not None and floor is not None and med <= floor}
            seed_floors = [floors[key][i] for i in trained]
            if None not in per_seed and all(None not in f for f in seed_floors):
                ranks = [rank_among(g, f) for g, f in zip(per_seed, seed_floors)]
                entry[key].update(ranks=ranks, rank_p=rank_sum_p(ranks, [len(f) for f in seed_floors]))
        entry["holds"] = all(entry[key]["within_floor"] for key, _ in GAPS)
        out["variants"][name] = entry
    # The gaps are magnitudes. With their signs: where the nudged run and a recipe land on the same side of BF16
    # seed after seed, the BF16 run itself sits off the perturbed runs, and every gap of that seed carries it.
    nudged = list(dict.fromkeys(n for r in runs for n in nudged_runs(r)))
    out["signed"] = {}
    for name in (*nudged, *variants):
        trained = [r for r in runs if name in r["variants"]]
        out["signed"][name] = {"seeds": [r["config"]["seed"] for r in trained],
                               **{key: [signed(r, name, key) for r in trained] for key, _ in SIGNED}}
    return out


def by_seed(seeds: list[int], trained: list[int], values: list, fmt) -> str:
    """One column per seed: the value where the run was trained ("failed" for a failed run), "-" where it was not."""
    at = dict(zip(trained, values))
    return " ".join(f"{(fmt(at[s]) if s in at else '-'):>9}" for s in seeds)


def table(summary: dict) -> str:
    pct = lambda x: "failed" if x is None else f"{x * 100:.2f}%"  # noqa: E731
    seeds = summary["seeds"]
    w = max(16, *(len(n) + 1 for n in summary["signed"]))  # the label column
    lines = [f"seeds {seeds}; medians over seeds, each gap relative to the BF16 baseline of its own seed "
             "(- : not trained in that seed; a recipe is judged over the seeds it was trained in)"]
    for key, label in GAPS:
        floor = summary["floor"][key]
        lines.append(f"\n{label:<{w}} " + " ".join(f"{'seed ' + str(s):>9}" for s in seeds) + f" {'median':>9}")
        several = max(floor["runs_per_seed"]) > 1
        lines.append(f"{'nudged BF16':<{w}} " + " ".join(f"{pct(x):>9}" for x in floor["per_seed"])
                     + f" {pct(floor['median']):>9}"
                     + (f"  (per seed: the median of its {floor['runs_per_seed']} nudged runs; median: of all "
                        f"{len(floor['all'])})" if several else ""))
        for name, entry in summary["variants"].items():
            e = entry[key]
            lines.append(f"{name:<{w}} " + by_seed(seeds, entry["seeds"], e["per_seed"], pct)
                         + f" {pct(e['median']):>9}  {'within' if e['within_floor'] else 'OUTSIDE'}")
    signs = lambda x: "failed" if x is None else f"{x * 100:+.2f}%"  # noqa: E731
    for key, label in SIGNED:
        lines.append(f"\n{label + ' vs BF16':<{w}} " + " ".join(f"{'seed ' + str(s):>9}" for s in seeds)
                     + "  (signed: run - BF16)")
        for name, per_seed in summary["signed"].items():
            k = nudged_index(name)
            label = name if k is None else "nudged BF16" + (f" #{k}" if k > 1 else "")
            lines.append(f"{label:<{w}} " + by_seed(seeds, per_seed["seeds"], per_seed[key], signs))
    lines.append("\nrank of each gap among its seed's nudged gaps (1 = smallest); p: the chance of a rank sum this "
                 "high if the recipe moved training no more than a nudge")
    runs_per_seed = dict(zip(seeds, summary["floor"][GAPS[0][0]]["runs_per_seed"]))
    for key, label in GAPS:
        for name, entry in summary["variants"].items():
            e = entry[key]
            if "ranks" in e:
                lines.append(f"{label:<15} {name:<18} " + " ".join(f"{r:>4g}" for r in e["ranks"])
                             + f"  of {[runs_per_seed[s] + 1 for s in entry['seeds']]}  p = {e['rank_p']:.2f}")
    lines.append("")
    for name, entry in summary["variants"].items():
        over = "" if entry["seeds"] == seeds else f", over seeds {entry['seeds']} only"
        lines.append(f"{name}: {'holds' if entry['holds'] else 'does not hold'} (median final-loss and val-loss "
                     f"gaps within the nudged medians{over})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="converge --out directories (or converge.json files): one or more per "
                                           "seed")
    p.add_argument("--out", help="write the summary as JSON here")
    args = p.parse_args(argv)
    summary = summarize(load(args.runs))
    print(table(summary))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(e["holds"] for e in summary["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
