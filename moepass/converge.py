"""`moepass converge`: BF16 (Inductor) and moepass trained from the same seed on the same batches.

Loss parity is judged on smoothed curves: the final loss of a run is its mean training loss over
the last `window` steps (both runs see the same batches there), and the largest gap is the worst
such window anywhere in the run. PASS when the final gap is within --tolerance (relative).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import time
import traceback

import torch

from .bench import (BASELINE, ModelSpec, Variant, add_model_arguments, error_summary, model_spec, provenance,
                    resolve_variants, say)

RERUN = f"{BASELINE}-rerun"  # --repeat-baseline: the same baseline trained again
NUDGED = f"{BASELINE}-nudged"  # --nudged-baseline: the baseline from weights moved by an ulp or two
NUDGE = 2.0**-7  # relative: at least one bf16 ulp (bf16's spacing is 2^-8 to 2^-7 of the value)
SCHEMA = "moepass.converge/1"


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


def moving_average(values: list[float], window: int) -> list[float]:
    """Means of every full trailing window: element i covers values[i : i + window]."""
    if not 1 <= window <= len(values):
        raise ValueError(f"window {window} must be in [1, {len(values)}]")
    out, acc = [], sum(values[:window])
    out.append(acc / window)
    for i in range(window, len(values)):
        acc += values[i] - values[i - window]
        out.append(acc / window)
    return out


def loss_gaps(baseline: list[float], candidate: list[float], window: int) -> dict:
    """Relative gaps |candidate - baseline| / baseline of the moving-average losses."""
    if len(baseline) != len(candidate):
        raise ValueError(f"curves differ in length: {len(baseline)} vs {len(candidate)}")
    w = min(window, len(baseline))
    gaps = [abs(c - b) / b for b, c in zip(moving_average(baseline, w), moving_average(candidate, w))]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"final_loss_gap_rel": gaps[-1], "max_window_gap_rel": gaps[worst],
            "max_window_gap_end_step": worst + w, "window_used": w}


def worst(gaps: list[float]) -> float | None:
    """The largest gap; NaN (a diverged run) wins, None when nothing was compared."""
    if not gaps:
        return None
    return math.nan if any(math.isnan(g) for g in gaps) else max(gaps)


def compare(runs: dict, names: list[str], window: int, tolerance: float, baseline: str = BASELINE) -> dict:
    """Add gaps and pass to each compared run; return the verdict (worst gaps, overall pass).

    Fails when any run failed or diverged (NaN gap).
    """
    base = runs[baseline]
    compared = [runs[n] for n in names if runs[n]["status"] == "ok" and base["status"] == "ok"]
    for run in compared:
        run.update(loss_gaps(base["loss"], run["loss"], window))
        run["val_loss_gap_rel"] = abs(run["val_loss"] - base["val_loss"]) / base["val_loss"]
        run["pass"] = run["final_loss_gap_rel"] <= tolerance  # NaN compares False: a diverged run fails
    for run in runs.values():
        if run["status"] == "ok":
            run["final_loss"] = statistics.mean(run["loss"][-min(window, len(run["loss"])):])
            run["last_loss"] = run["loss"][-1]
    return {"final_loss_gap_rel": worst([r["final_loss_gap_rel"] for r in compared]),
            "max_window_gap_rel": worst([r["max_window_gap_rel"] for r in compared]),
            "window": window, "tolerance": tolerance, "criterion": "final_loss_gap_rel <= tolerance",
            "pass": len(compared) == len(names) and all(r["pass"] for r in compared)}


def validation_loss(forward, batches, n: int, device: torch.device) -> float:
    """Mean loss over n held-out batches through the training forward (grad on: reuses the compiled graph)."""
    from .train import next_token_loss

    losses = []
    for i in range(n):
        inputs, targets = (t.to(device) for t in batches[i])
        losses.append(next_token_loss(forward(inputs), targets).item())
    return statistics.mean(losses)


def train_variant(variant: Variant, spec: ModelSpec, batches, val_batches, *, steps: int, lr: float, lr_warmup: int,
                  seed: int, device: torch.device, val_n: int, log_every: int, nudge: bool = False) -> dict:
    from .train import train

    entry = {"backend": variant.backend or "eager", "options": variant.options}
    start = time.perf_counter()
    try:
        torch._dynamo.reset()
        model = spec.build(seed, device)
        if nudge:
            nudge_weights(model, seed + 1)
        forward = variant.compile(model)

        def on_step(r) -> None:
            if r.step == 0 or (r.step + 1) % log_every == 0 or r.step + 1 == steps:
                say(f"  {variant.name:<18} step {r.step + 1:>5}/{steps}  loss {r.loss:8.4f}  {r.seconds * 1e3:9.1f} ms")

        results = train(model, forward, batches, steps, device, lr=lr, on_step=on_step, lr_warmup=lr_warmup)
        entry.update(status="ok", loss=[r.loss for r in results],
                     val_loss=validation_loss(forward, val_batches, val_n, device))
    except Exception as e:  # noqa: BLE001 - report the failure, compare what did run
        traceback.print_exc()
        entry.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
    entry["seconds"] = time.perf_counter() - start
    return entry


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=300, batch=4, seq=128)
    p.add_argument("--variants", default="moepass",
                   help="comma list of variants compared against the BF16 baseline 'inductor' "
                        "(moepass = all passes; or a single pass name) (default: moepass)")
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
    p.add_argument("--nudged-baseline", action="store_true",
                   help=f"also train {BASELINE!r} from weights moved by 1-2 bf16 ulps (random signs) and report its "
                        "gap: how far this model and lr amplify a numerically insignificant change, the floor for "
                        "judging a recipe's gap (a rerun in the same process repeats Inductor's choices exactly)")


def cmd_converge(args) -> int:
    from . import plot
    from .bench import write_outputs
    from .data import Batches, load_corpus

    names = [n.strip() for n in args.variants.split(",") if n.strip() and n.strip() != BASELINE]
    variants = resolve_variants([BASELINE, *names], json.loads(args.options) if args.options else None)
    if args.window < 1 or args.steps < 1:
        raise SystemExit("moepass converge: --steps and --window must be at least 1")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("moepass converge runs in one process: start it without torchrun")
    if not names:
        raise SystemExit(f"moepass converge: --variants names nothing to compare against {BASELINE!r}")
    spec = model_spec(args)
    device = torch.device(args.device)
    train_tokens, val_tokens = load_corpus(args.data)
    batches = Batches(train_tokens, args.batch, args.seq, seed=args.seed)
    val_batches = Batches(val_tokens, args.batch, args.seq, seed=args.seed)
    log_every = args.log_every or max(1, args.steps // 20)
    say(f"moepass converge: {spec.describe()} on {device}, {args.steps} steps of batch {args.batch} x seq "
        f"{args.seq}, data {args.data or 'stdlib source (bytes)'}; {[v.name for v in variants]}")

    floors = {RERUN: (args.repeat_baseline, "noise_floor_gap_rel", "its own rerun"),
              NUDGED: (args.nudged_baseline, "nudged_floor_gap_rel", "itself from weights nudged by an ulp")}
    variants += [dataclasses.replace(variants[0], name=name) for name, (asked, _, _) in floors.items() if asked]
    runs = {}
    for i, v in enumerate(variants, start=1):
        say(f"[{i}/{len(variants)}] {v.name}: backend={v.backend} options={v.options}")
        runs[v.name] = train_variant(v, spec, batches, val_batches, steps=args.steps, lr=args.lr,
                                     lr_warmup=args.lr_warmup, seed=args.seed, device=device,
                                     val_n=args.val_batches, log_every=log_every, nudge=v.name == NUDGED)

    verdict = compare(runs, names, args.window, args.tolerance)
    notes = []
    for name, (asked, key, against) in floors.items():
        if asked and runs[name]["status"] == "ok" and runs[BASELINE]["status"] == "ok":
            runs[name].update(loss_gaps(runs[BASELINE]["loss"], runs[name]["loss"], args.window))
            verdict[key] = runs[name]["final_loss_gap_rel"]
            notes.append(f"the baseline against {against}: {verdict[key] * 100:.3f}%")
    say("\n" + summary(runs, args))
    gap = verdict["final_loss_gap_rel"]
    say(f"{'PASS' if verdict['pass'] else 'FAIL'}: final-loss gap "
        f"{'n/a' if gap is None else f'{gap * 100:.3f}%'} vs tolerance {args.tolerance * 100:.3f}%"
        + (f" ({'; '.join(notes)})" if notes else ""))
    result = provenance(SCHEMA, device, 1)
    result.update(config={"model": spec.describe(), "batch": args.batch, "seq": args.seq, "steps": args.steps,
                          "lr": args.lr, "lr_warmup": args.lr_warmup, "seed": args.seed,
                          "data": args.data or "stdlib", "device": str(device),
                          "val_batches": args.val_batches},
                  baseline=BASELINE, variants=runs, **verdict)
    write_outputs(result, args.out, "converge", plot.loss_curves)
    return 0 if verdict["pass"] else 1


def summary(runs: dict, args) -> str:
    """Loss side by side every few steps, then final (window mean), validation loss and gaps."""
    ok = {n: r for n, r in runs.items() if r["status"] == "ok"}
    lines = ["step  " + "".join(f"{n:>18}" for n in ok)]
    steps = len(next(iter(ok.values()))["loss"]) if ok else 0
    every = max(1, steps // 10)
    for s in [*range(0, steps, every), *([steps - 1] if (steps - 1) % every else [])]:
        lines.append(f"{s + 1:>4}  " + "".join(f"{r['loss'][s]:>18.4f}" for r in ok.values()))
    lines.append(f"\n{'variant':<18} {'final loss':>11} {'val loss':>10} {'final gap':>10} {'max window gap':>15}")
    for n, r in runs.items():
        if r["status"] != "ok":
            lines.append(f"{n:<18} FAILED: {error_summary(r['error'])}")
            continue
        gap = "-" if "final_loss_gap_rel" not in r else f"{r['final_loss_gap_rel'] * 100:.3f}%"
        win = "-" if "max_window_gap_rel" not in r else f"{r['max_window_gap_rel'] * 100:.3f}%"
        lines.append(f"{n:<18} {r['final_loss']:>11.4f} {r['val_loss']:>10.4f} {gap:>10} {win:>15}")
    lines.append(f"final loss = mean training loss over the last {min(args.window, steps)} steps "
                 "(the same batches in every run)")
    return "\n".join(lines)
