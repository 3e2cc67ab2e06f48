"""Speed and memory per MoE layer: the difference of two `moepass bench` depths at the same dims.

A shallow proxy of DeepSeek-V3 spends much of its step outside the MoE layers (the output head is about a third
of a 3-layer proxy's FLOPs, and it stays BF16), so its whole-step speedup understates what a 61-layer model gets.
The cost of one more MoE layer is (step(deep) - step(shallow)) / (deep - shallow) layers, for every variant the
two runs share; the speedup per layer is the baseline's per-layer time over the variant's. A peer variant (for
example torchao_fp8) gets the ratio of the two speedups. Peak memory is reported at the deeper run, as is; where
the runs recorded it (CUDA), so is what one more layer keeps for its backward.

    moepass bench ... --layers 5 --out deep && moepass bench ... --layers 2 --out shallow
    python examples/per_layer.py deep/bench.json shallow/bench.json --peer torchao_fp8 [--out per_layer.json]

Both runs must share every config entry except n_layers, and the extra layers must all be MoE layers
(n_dense_layers at most the shallow depth), else the script refuses and names what differs.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys


def _layers(run: dict) -> int:
    layers = run["config"]["model"].get("overrides", {}).get("n_layers")
    if layers is None:
        raise SystemExit("per_layer: a run's bench.json records no n_layers; run `moepass bench` with --layers")
    return layers


def _without_depth(run: dict) -> dict:
    config = copy.deepcopy(run["config"])
    config["model"]["overrides"].pop("n_layers")
    return config


def per_layer(deep: dict, shallow: dict, peer: str | None = None) -> dict:
    """Per-MoE-layer step time, speedup and (at the deeper run) peak memory of every variant both runs hold."""
    extra = _layers(deep) - _layers(shallow)
    if _without_depth(deep) != _without_depth(shallow):
        diff = sorted(k for k in set(deep["config"]) | set(shallow["config"])
                      if deep["config"].get(k) != shallow["config"].get(k))
        raise SystemExit(f"per_layer: the two runs differ in more than their depth ({', '.join(diff)}); "
                         "run both with the same command but --layers")
    if extra <= 0:
        raise SystemExit(f"per_layer: give the deeper run first ({_layers(deep)} layers, then {_layers(shallow)})")
    dense = deep["config"]["model"]["overrides"].get("n_dense_layers", 0)
    if dense > _layers(shallow):
        raise SystemExit(f"per_layer: n_dense_layers={dense} exceeds the shallow depth {_layers(shallow)}: "
                         "the layers between the two depths would not all be MoE layers")
    baseline = deep["baseline"]
    if shallow["baseline"] != baseline:
        raise SystemExit(f"per_layer: the runs have different baselines ({baseline}, {shallow['baseline']})")
    runs = {which: {v["name"]: v for v in r["variants"] if v.get("status") == "ok"}
            for which, r in (("deep", deep), ("shallow", shallow))}
    names = [n for n in runs["deep"] if n in runs["shallow"]]
    if baseline not in names:
        raise SystemExit(f"per_layer: the baseline {baseline!r} did not finish in both runs")
    layer_ms = {n: (runs["deep"][n]["step_ms_median"] - runs["shallow"][n]["step_ms_median"]) / extra
                for n in names}
    base_peak = runs["deep"][baseline]["peak_mem_bytes"]
    rows = {n: {"layer_ms": layer_ms[n],
                "speedup": layer_ms[baseline] / layer_ms[n],
                "peak_gib_deep": runs["deep"][n]["peak_mem_bytes"] / 2**30,
                "peak_vs_baseline": runs["deep"][n]["peak_mem_bytes"] / base_peak} for n in names}
    for n in names:  # what one more MoE layer keeps for the backward (bench records it on CUDA)
        kept = [runs[which][n].get("kept_for_backward_bytes") for which in ("deep", "shallow")]
        if None not in kept:
            rows[n]["kept_gib_per_layer"] = (kept[0] - kept[1]) / extra / 2**30
    if peer is not None:
        if peer not in rows:
            raise SystemExit(f"per_layer: the peer {peer!r} did not finish in both runs (have: {', '.join(names)})")
        for row in rows.values():
            row["speedup_vs_peer"] = row["speedup"] / rows[peer]["speedup"]
    return {"baseline": baseline, "peer": peer, "layers": [_layers(deep), _layers(shallow)],
            "commits": [deep.get("commit"), shallow.get("commit")], "variants": rows}


def table(result: dict) -> str:
    deep, shallow = result["layers"]
    peer = result["peer"]
    head = f"{'variant':<19} {'ms per MoE layer':>17} {'speedup':>8}"
    head += f" {'/ ' + peer:>16}" if peer else ""
    head += f" {f'peak GiB ({deep} layers)':>20} {'peak ratio':>10}"
    lines = [f"per MoE layer = (step at {deep} layers - step at {shallow}) / {deep - shallow}; "
             f"baseline {result['baseline']}", head, "-" * len(head)]
    for name, r in result["variants"].items():
        line = f"{name:<19} {r['layer_ms']:>17.1f} {r['speedup']:>7.3f}x"
        line += f" {r['speedup_vs_peer']:>15.3f}x" if peer else ""
        line += f" {r['peak_gib_deep']:>20.1f} {r['peak_vs_baseline']:>9.3f}x"
        if "kept_gib_per_layer" in r:
            line += f"  kept for the backward {r['kept_gib_per_layer']:.2f} GiB per layer"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("deep", help="bench.json of the deeper run")
    p.add_argument("shallow", help="bench.json of the shallower run (same command, fewer --layers)")
    p.add_argument("--peer", help="a variant whose per-layer speedup the others are compared with")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)
    deep, shallow = (json.loads(pathlib.Path(f).read_text()) for f in (args.deep, args.shallow))
    result = per_layer(deep, shallow, args.peer)
    print(table(result))
    if args.out:
        result["command"] = " ".join(["python", "examples/per_layer.py", *sys.argv[1:]])
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
