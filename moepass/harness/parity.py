"""Loss parity between two training runs, judged on moving averages of their loss curves.

The final loss of a run is its mean training loss over the last `window` steps (both runs see the same
batches there), and the largest gap is the worst such window anywhere in the run.
"""

from __future__ import annotations

import math
import statistics

from .variants import BASELINE


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
