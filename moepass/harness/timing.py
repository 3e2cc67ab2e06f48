"""Throughput, compile time and speedups from per-step wall times."""

from __future__ import annotations

import statistics

from .variants import BASELINE

COMPILE_S_METHOD = ("sum over warm-up steps of (step time - median timed step time); Inductor's on-disk caches "
                    "(on by default) can serve a repeated compile")


def timing_stats(step_s: list[float], warmup: int, tokens_per_step: int, world: int) -> dict:
    """Throughput from the timed steps; compile time from the warm-up steps (COMPILE_S_METHOD)."""
    timed = step_s[warmup:]
    median = statistics.median(timed)
    return {
        "timed_steps": len(timed),
        "step_ms": [t * 1e3 for t in timed],
        "step_ms_median": median * 1e3,
        "step_ms_min": min(timed) * 1e3,
        "step_ms_max": max(timed) * 1e3,
        "tokens_per_step": tokens_per_step,
        # throughput over the median step (not the median of per-step rates) so speedups are time ratios
        "tokens_per_s_median": tokens_per_step / median,
        "tokens_per_s_min": tokens_per_step / max(timed),
        "tokens_per_s_max": tokens_per_step / min(timed),
        "tokens_per_s_per_device_median": tokens_per_step / median / world,
        "first_step_s": step_s[0],
        "compile_s": sum(t - median for t in step_s[:warmup]),
    }


def add_speedups(entries: list[dict], baseline: str = BASELINE) -> str | None:
    """speedup = baseline median step time / variant median step time; None where either failed."""
    ok = [e for e in entries if e["status"] == "ok"]
    base = next((e for e in ok if e["name"] == baseline), ok[0] if ok else None)
    for e in entries:
        e["speedup_vs_baseline"] = (base["step_ms_median"] / e["step_ms_median"]
                                    if base is not None and e["status"] == "ok" else None)
    return base["name"] if base else None
