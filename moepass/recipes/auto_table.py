"""The measured tables behind recipe="auto" on Hopper: FP8 rowwise against BF16, per GEMM and per token count.

One table per GPU model, shipped as moepass/recipes/fp8_auto_table_<gpu>.json and read only on the GPU model it was
measured on (by name: an H100 moves 3.35 TB/s, an H200 4.8, so the same GEMM's margin differs). Each row is one
GEMM shape at one token count, timed by `python examples/bench_fp8_gemms.py --auto-table` (the command that
re-derives a table), quantization included:
- linear rows: a linear's forward, dgrad and wgrad, compiled as moepass compiles them, (K, N) at M tokens;
- grouped rows: a routed expert MLP in context (the gather of the routed tokens, w1 and w3, SiLU*up, w2,
  forward and backward), since alone each grouped GEMM loses while in the model Inductor fuses the
  activations' quantization into their producers. Keyed by the MLP's (dim, inter) at tokens per expert.

- grouped_received rows: the same MLP on rows whose count is data dependent, as the experts get them after an
  expert-parallel exchange (`python examples/bench_fp8_gemms.py --received-rows` measures both side by side):
  the quantization then runs unfused (the op stays opaque), so these rows are what recipe="auto" reads there.

A GEMM whose shape the table holds is decided by the speedup at its token count, interpolated in log(tokens)
between the two measured counts around it. Below the smallest count measured it stays BF16 (unmeasured, and
FP8's margin shrinks with M); above the largest it takes the largest's (the margin grows with M). Shapes the
table does not hold are measured on the GPU itself (recipes.measure) or fall back to the size rule
auto.FP8_ROWWISE_MIN.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import pathlib

SCHEMA = "moepass.fp8_auto_table/1"
# The tables shipped with moepass: one file per GPU model, each naming the GPU it was measured on.
SHIPPED_DIR = pathlib.Path(__file__).parent
SHIPPED_GLOB = "fp8_auto_table_*.json"
SHIPPED = SHIPPED_DIR / "fp8_auto_table_h200.json"  # the first table measured; the size rule was read off it
SHIPPED_NAME = f"moepass/recipes/{SHIPPED.name}"  # as reasons quote it
# FP8 must beat BF16 by this much to be picked: FP8 costs accuracy, and smaller margins are within the noise
# of the timings (docs/recipes.md, `recipe="auto"`).
MIN_SPEEDUP = 1.03


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The table's answer for one GEMM: its interpolated speedup (None: outside what was measured) and how."""

    speedup: float | None
    detail: str

    @property
    def fp8(self) -> bool:
        return self.speedup is not None and self.speedup >= MIN_SPEEDUP


class AutoTable:
    def __init__(self, data: dict, source: str):
        if data.get("schema") != SCHEMA:
            raise ValueError(f"{source}: schema {data.get('schema')!r} is not {SCHEMA!r}; re-derive it with "
                             "`python examples/bench_fp8_gemms.py --auto-table`")
        self.source, self.gpu, self.capability = source, data["gpu"], tuple(data["capability"])
        self._linear: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for r in data["linear"]:
            self._linear.setdefault((r["K"], r["N"]), []).append((r["tokens"], r["speedup"]))
        self._grouped = _mlp_curves(data["grouped"])
        self._grouped_received = _mlp_curves(data.get("grouped_received", []))
        for curve in self._linear.values():
            curve.sort()

    def linear(self, k: int, n: int, tokens: int) -> Verdict | None:
        """None when (K, N) was not measured."""
        curve = self._linear.get((k, n))
        return None if curve is None else _interpolate(curve, tokens, "M", f"linear K={k} N={n}")

    def grouped(self, k: int, n: int, tokens_per_expert: int, received: bool = False) -> Verdict | None:
        """An expert GEMM (K, N) of a measured MLP: w1 or w3 (dim, inter), both fused (dim, 2*inter), w2 (inter, dim).

        received: its rows come from an expert-parallel exchange (data-dependent count): the grouped_received rows.
        """
        curves = self._grouped_received if received else self._grouped
        for (dim, inter), curve in curves.items():
            if (k, n) in ((dim, inter), (dim, 2 * inter), (inter, dim)):
                rows = " on received (data-dependent) rows" if received else ""
                return _interpolate(curve, tokens_per_expert, "tokens per expert",
                                    f"expert MLP dim={dim} inter={inter}{rows}")
        return None


def _mlp_curves(rows: list[dict]) -> dict[tuple[int, int], list[tuple[int, float]]]:
    curves: dict[tuple[int, int], list[tuple[int, float]]] = {}
    for r in rows:
        curves.setdefault((r["dim"], r["inter"]), []).append((r["tokens_per_expert"], r["speedup"]))
    return {mlp: sorted(curve) for mlp, curve in curves.items()}


def _interpolate(curve: list[tuple[int, float]], tokens: int, unit: str, what: str) -> Verdict:
    counts = [t for t, _ in curve]
    measured = ", ".join(f"{s:.2f}x at {t}" for t, s in curve)
    if tokens < counts[0]:
        return Verdict(None, f"{what}: {unit}={tokens} is below the smallest measured ({counts[0]}; {measured})")
    i = bisect.bisect_left(counts, tokens)
    if i < len(counts) and counts[i] == tokens:
        return Verdict(curve[i][1], f"{what}: measured {curve[i][1]:.2f}x at {unit}={tokens}")
    if i == len(counts):
        return Verdict(curve[-1][1], f"{what}: {curve[-1][1]:.2f}x at the largest {unit} measured "
                                     f"({counts[-1]}), here {tokens}")
    (t0, s0), (t1, s1) = curve[i - 1], curve[i]
    s = s0 + (s1 - s0) * (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
    return Verdict(s, f"{what}: {s:.2f}x at {unit}={tokens}, interpolated in log {unit} between "
                      f"{s0:.2f}x at {t0} and {s1:.2f}x at {t1}")


@functools.cache
def shipped_tables() -> dict[str, AutoTable]:
    """{GPU name as torch.cuda.get_device_name gives it: its table} for every table in the package."""
    tables = {}
    for path in sorted(SHIPPED_DIR.glob(SHIPPED_GLOB)):
        table = AutoTable(json.loads(path.read_text()), f"moepass/recipes/{path.name}")
        tables[table.gpu] = table
    return tables


def for_gpu(name: str) -> AutoTable | None:
    """The shipped table measured on the GPU model `name`, or None (then GEMMs are measured or take the rule)."""
    return shipped_tables().get(name)


def shipped() -> AutoTable | None:
    """The H200 table (the size rule's source), or None when it is absent."""
    return shipped_tables().get("NVIDIA H200")
