"""`moepass converge`: BF16 (Inductor) and moepass trained from the same seed on the same batches.

Loss parity is judged on smoothed curves (parity.py); PASS when the final gap is within --tolerance (relative).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import traceback

import torch

from . import plot
from .corpus import Batches, load_corpus
from .flags import add_model_arguments, model_spec
from .model_spec import ModelSpec
from .output import error_summary, say, write_json, write_outputs
from .parity import compare, loss_gaps
from .provenance import provenance
from .train import optimizer_name, train, with_loss
from .variants import BASELINE, Variant, parse_custom_variant, resolve_variants

RERUN = f"{BASELINE}-rerun"  # --repeat-baseline: the same baseline trained again
NUDGED = f"{BASELINE}-nudged"  # --nudged-baseline: the baseline from weights moved by an ulp or two
NUDGE = 2.0**-7  # relative: at least one bf16 ulp (bf16's spacing is 2^-8 to 2^-7 of the value)
SCHEMA = "moepass.converge/1"


def nudged_name(k: int) -> str:
    """The k-th nudged floor (1-based): NUDGED, then NUDGED-2, NUDGED-3, ... (--nudged-baseline N)."""
    return NUDGED if k == 1 else f"{NUDGED}-{k}"


def nudged_index(name: str) -> int | None:
    """k for the k-th nudged floor's name (nudged_name(k)), None for any other run."""
    if name == NUDGED:
        return 1
    k = name[len(NUDGED) + 1:] if name.startswith(f"{NUDGED}-") else ""
    return int(k) if k.isdigit() else None


def is_nudged(name: str) -> bool:
    return nudged_index(name) is not None


def nudge_seed(seed: int, name: str) -> int:
    """The sign pattern of a nudged floor: seed + 1 for the first (as every earlier run), far apart for the rest."""
    return seed + 1 + 7919 * (nudged_index(name) - 1)


def nudge_weights(model: torch.nn.Module, seed: int) -> None:
    """Multiply every floating-point parameter element by 1 +- NUDGE (random sign, fixed by seed), in place.

    A numerically insignificant change, like any low-precision recipe's rounding but with no bias: how far a
    BF16 run drifts from it is the floor below which a recipe's loss gap says nothing about its numerics.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                sign = torch.randint(0, 2, p.shape, generator=gen).to(p.device, torch.float32) * 2 - 1
                p.copy_((p.float() * (1 + NUDGE * sign)).to(p.dtype))


def validation_loss(loss_of, batches, n: int, device: torch.device) -> float:
    """Mean loss over n held-out batches through the training step's loss (grad on: reuses the compiled graph)."""
    losses = []
    for i in range(n):
        inputs, targets = (t.to(device) for t in batches[i])
        losses.append(loss_of(inputs, targets).item())
    return statistics.mean(losses)


def train_variant(variant: Variant, spec: ModelSpec, batches, val_batches, *, steps: int, lr: float, lr_warmup: int,
                  seed: int, device: torch.device, val_n: int, log_every: int, nudge: int | None = None) -> dict:
    entry = {"backend": variant.backend or "eager", "options": variant.options}
    unavailable = variant.problem(device)
    if unavailable:  # a peer recipe this device cannot run: said, not silently replaced by plain Inductor
        say(f"  {variant.name}: not run: {unavailable}")
        return {**entry, "status": "unavailable", "error": unavailable, "seconds": 0.0}
    start = time.perf_counter()
    try:
        torch._dynamo.reset()
        model = spec.build(seed, device)
        if nudge is not None:
            nudge_weights(model, nudge)
        variant.prepare(model)  # a peer recipe converts the weights before the optimizer sees them
        loss_of = variant.compile(with_loss(model))  # the loss compiled with the model, as `moepass bench` runs it

        def on_step(r) -> None:
            if r.step == 0 or (r.step + 1) % log_every == 0 or r.step + 1 == steps:
                say(f"  {variant.name:<19} step {r.step + 1:>5}/{steps}  loss {r.loss:8.4f}  {r.seconds * 1e3:9.1f} ms")

        results = train(model, loss_of, batches, steps, device, lr=lr, on_step=on_step, lr_warmup=lr_warmup,
                        loss_included=True)
        entry.update(status="ok", loss=[r.loss for r in results],
                     val_loss=validation_loss(loss_of, val_batches, val_n, device))
    except Exception as e:  # noqa: BLE001 - report the failure, compare what did run
        traceback.print_exc()
        entry.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
    entry["seconds"] = time.perf_counter() - start
    return entry


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=300, batch=4, seq=128)
    p.add_argument("--variants", default=None,
                   help="comma list of variants compared against the BF16 baseline 'inductor' "
                        "(moepass = all passes; or a single pass name) (default: moepass, or none with --variant)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                   help="an extra moepass variant: the default passes with --options updated by JSON (repeatable), "
                        "e.g. --variant 'blockwise={\"recipe\": \"blockwise\"}': several recipes against one "
                        "baseline (and one nudged floor) in one run")
    p.add_argument("--tolerance", type=float, default=0.01, help="largest relative final-loss gap that passes")
    p.add_argument("--window", type=int, default=20, help="moving-average window, steps")
    p.add_argument("--val-batches", type=int, default=8, help="held-out batches for the final validation loss")
    p.add_argument("--out", default=".", help="directory for converge.json and converge.png")
    p.add_argument("--lr-warmup", type=int, default=0, metavar="STEPS",
                   help="ramp the learning rate linearly over the first STEPS steps (large models at a high "
                        "lr otherwise spike early, and the runs then diverge for reasons unrelated to precision)")
    p.add_argument("--repeat-baseline", action="store_true",
                   help=f"train {BASELINE!r} twice and report the gap between the two runs: the run-to-run "
                        "noise floor of the criterion (GPU kernels with atomics are not bitwise reproducible)")
    p.add_argument("--nudged-baseline", type=int, nargs="?", const=1, default=0, metavar="N",
                   help=f"also train {BASELINE!r} from weights moved by 1-2 bf16 ulps (random signs) and report its "
                        "gap: how far this model and lr amplify a numerically insignificant change, the floor for "
                        "judging a recipe's gap (a rerun in the same process repeats Inductor's choices exactly). "
                        "N: that many nudged runs, each its own sign pattern (a floor from one run is one sample "
                        "of a spread)")
    p.add_argument("--baseline-from", default=None, metavar="CONVERGE_JSON",
                   help=f"take {BASELINE!r} (and the nudged/rerun floors it has) from an earlier run's converge.json "
                        "with the same model, data, steps, lr, seed and device kind instead of training them again: "
                        "new recipes judged against a baseline already trained (long runs split over several jobs)")


def cmd_converge(args) -> int:
    custom = dict(parse_custom_variant(spec) for spec in args.variant)
    if len(custom) != len(args.variant):
        raise SystemExit(f"moepass converge: a --variant label is given twice in {args.variant}")
    # with only --variant given, the default 'moepass' variant is not trained unless --variants names it
    listed = args.variants if args.variants is not None else ("" if custom else "moepass")
    names = [n.strip() for n in listed.split(",") if n.strip() and n.strip() != BASELINE]
    variants = resolve_variants([BASELINE, *names], json.loads(args.options) if args.options else None, custom)
    names += list(custom)
    if args.window < 1 or args.steps < 1:
        raise SystemExit("moepass converge: --steps and --window must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("moepass converge runs in one process: start it without torchrun")
    if not names:
        raise SystemExit(f"moepass converge: --variants names nothing to compare against {BASELINE!r}")
    if args.nudged_baseline < 0:
        raise SystemExit("moepass converge: --nudged-baseline N needs N >= 1 (or no N for one nudged run)")
    spec = model_spec(args)
    device = torch.device(args.device)
    config = {"model": spec.describe(), "batch": args.batch, "seq": args.seq, "steps": args.steps, "lr": args.lr,
              "lr_warmup": args.lr_warmup, "seed": args.seed, "data": args.data or "stdlib", "device": str(device),
              "optimizer": optimizer_name(device), "val_batches": args.val_batches}
    reused = earlier_baseline(args.baseline_from, config) if args.baseline_from else {}
    train_tokens, val_tokens = load_corpus(args.data)
    batches = Batches(train_tokens, args.batch, args.seq, seed=args.seed)
    val_batches = Batches(val_tokens, args.batch, args.seq, seed=args.seed)
    log_every = args.log_every or max(1, args.steps // 20)
    say(f"moepass converge: {spec.describe()} on {device}, {args.steps} steps of batch {args.batch} x seq "
        f"{args.seq}, data {args.data or 'stdlib source (bytes)'}; {[v.name for v in variants]}")

    nudged = [nudged_name(k) for k in range(1, args.nudged_baseline + 1)]
    nudged += sorted((n for n in reused if is_nudged(n) and n not in nudged), key=nudged_index)
    floors = {RERUN: (args.repeat_baseline or RERUN in reused, "noise_floor_gap_rel", "its own rerun"),
              **{name: (True, "nudged_floor_gap_rel" if name == NUDGED else None,
                        "itself from weights nudged by an ulp" + ("" if name == NUDGED else f" ({name})"))
                 for name in nudged}}
    # the baseline and its floors first: a job cut off later still leaves them for --baseline-from
    variants[1:1] = [dataclasses.replace(variants[0], name=name) for name, (asked, _, _) in floors.items() if asked]
    meta = provenance(SCHEMA, device, 1)  # once: the partial writes and the final one share it
    runs = {}
    for i, v in enumerate(variants, start=1):
        if v.name in reused:
            say(f"[{i}/{len(variants)}] {v.name}: from {args.baseline_from}")
            runs[v.name] = reused[v.name]
            continue
        say(f"[{i}/{len(variants)}] {v.name}: backend={v.backend} options={v.options}")
        runs[v.name] = train_variant(v, spec, batches, val_batches, steps=args.steps, lr=args.lr,
                                     lr_warmup=args.lr_warmup, seed=args.seed, device=device,
                                     val_n=args.val_batches, log_every=log_every,
                                     nudge=nudge_seed(args.seed, v.name) if is_nudged(v.name) else None)
        if i < len(variants):  # what is finished survives a job cut off before the end (no verdict yet)
            write_json(dict(meta, config=config, baseline=BASELINE, variants=runs, complete=False), args.out,
                       "converge")

    verdict = compare(runs, names, args.window, args.tolerance)
    notes = []
    for name, (asked, key, against) in floors.items():
        if asked and runs[name]["status"] == "ok" and runs[BASELINE]["status"] == "ok":
            runs[name].update(loss_gaps(runs[BASELINE]["loss"], runs[name]["loss"], args.window))
            runs[name]["val_loss_gap_rel"] = abs(runs[name]["val_loss"] - runs[BASELINE]["val_loss"]) / \
                runs[BASELINE]["val_loss"]
            if key:
                verdict[key] = runs[name]["final_loss_gap_rel"]
            if is_nudged(name):
                verdict.setdefault("nudged_floor_gaps_rel", {})[name] = runs[name]["final_loss_gap_rel"]
            notes.append(f"the baseline against {against}: {runs[name]['final_loss_gap_rel'] * 100:.3f}%")
    say("\n" + summary(runs, args))
    gap = verdict["final_loss_gap_rel"]
    say(f"{'PASS' if verdict['pass'] else 'FAIL'}: final-loss gap "
        f"{'n/a' if gap is None else f'{gap * 100:.3f}%'} vs tolerance {args.tolerance * 100:.3f}%"
        + (f" ({'; '.join(notes)})" if notes else ""))
    result = dict(meta, config=config, baseline=BASELINE, variants=runs, complete=True, **verdict)
    if reused:
        result["baseline_from"] = {"path": args.baseline_from, "runs": sorted(reused)}
    write_outputs(result, args.out, "converge", plot.loss_curves)
    return 0 if verdict["pass"] else 1


def earlier_baseline(path: str, config: dict) -> dict:
    """The baseline runs (BF16 and its floors) of an earlier converge.json trained under `config`. Anything
    else that differs (model, data, steps, lr, seed, batches, device kind) would make the gaps meaningless."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"moepass converge: --baseline-from {path}: cannot read it ({type(e).__name__}: {e})")
    if earlier.get("schema") != SCHEMA or BASELINE not in earlier.get("variants", {}):
        raise SystemExit(f"moepass converge: --baseline-from {path} is not a {SCHEMA} result with a "
                         f"{BASELINE!r} run; give the converge.json that `moepass converge --out DIR` wrote")
    then = dict(earlier.get("config", {}), device=_device_kind(earlier.get("config", {}).get("device", "")))
    differ = {k: (then.get(k), v) for k, v in dict(config, device=_device_kind(config["device"])).items()
              if then.get(k) != v}
    if differ:
        raise SystemExit(f"moepass converge: --baseline-from {path} was trained differently: "
                         + "; ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differ.items())
                         + ". Give the same flags as that run, or train the baseline again (drop --baseline-from)")
    runs = {name: run for name, run in earlier["variants"].items() if name in (BASELINE, RERUN) or is_nudged(name)}
    if runs[BASELINE].get("status") != "ok":
        raise SystemExit(f"moepass converge: --baseline-from {path}: its {BASELINE!r} run did not finish "
                         f"({runs[BASELINE].get('status')})")
    return runs


def _device_kind(device: str) -> str:
    """cuda:0 and cuda:1 train alike; cpu and cuda do not."""
    return device.split(":")[0]


def summary(runs: dict, args) -> str:
    """Loss side by side every few steps, then final (window mean), validation loss and gaps."""
    ok = {n: r for n, r in runs.items() if r["status"] == "ok"}
    lines = ["step  " + "".join(f"{n:>18}" for n in ok)]
    steps = len(next(iter(ok.values()))["loss"]) if ok else 0
    every = max(1, steps // 10)
    for s in [*range(0, steps, every), *([steps - 1] if (steps - 1) % every else [])]:
        lines.append(f"{s + 1:>4}  " + "".join(f"{r['loss'][s]:>18.4f}" for r in ok.values()))
    lines.append(f"\n{'variant':<19} {'final loss':>11} {'val loss':>10} {'final gap':>10} {'val gap':>8} "
                 f"{'max window gap':>15}")
    for n, r in runs.items():
        if r["status"] != "ok":
            lines.append(f"{n:<19} {'n/a' if r['status'] == 'unavailable' else 'FAILED'}: {error_summary(r['error'])}")
            continue
        gap = "-" if "final_loss_gap_rel" not in r else f"{r['final_loss_gap_rel'] * 100:.3f}%"
        val = "-" if "val_loss_gap_rel" not in r else f"{r['val_loss_gap_rel'] * 100:.3f}%"
        win = "-" if "max_window_gap_rel" not in r else f"{r['max_window_gap_rel'] * 100:.3f}%"
        lines.append(f"{n:<19} {r['final_loss']:>11.4f} {r['val_loss']:>10.4f} {gap:>10} {val:>8} {win:>15}")
    lines.append(f"final loss = mean training loss over the last {min(args.window, steps)} steps "
                 "(the same batches in every run)")
    return "\n".join(lines)
