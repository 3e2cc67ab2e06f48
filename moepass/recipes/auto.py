"""recipe="auto": which recipe a linear or grouped expert GEMM gets, and why: mxfp8, fp8_rowwise or BF16.

MXFP8 on sm_100 and newer (native block-scaled FP8 tensor cores); FP8 rowwise on sm_89/sm_90 where it measured
faster than BF16 for the GEMM's shape, BF16 where quantizing would cost more than the faster GEMM saves; MXFP8
emulated on CPU (the reference numerics moepass is tested on). Where FP8 rowwise is a candidate, one of three sources
decides, and the reason names it:
  1. the shipped table of this GPU model (auto_table: H100, H200), for the shapes and token counts it holds;
  2. a measurement on this GPU (measure: timed once while the graph compiles, cached on disk), unless the option
     auto.measure is off or the rows are data dependent (received by expert parallelism);
  3. the size rule FP8_ROWWISE_MIN, read off the H200 table.
Also measured here: which weight gradients fp8_rowwise keeps in BF16 by default (WGRAD_BF16_AUTO).
"""

from __future__ import annotations

import dataclasses

import torch

from moepass.device_arch import probe
from moepass.analysis.graph import example_int

from . import auto_table, measure as measuring

BF16 = "bf16"  # the choice that leaves a GEMM as it is (no recipe has this name)


@dataclasses.dataclass(frozen=True)
class MinShape:
    """Smallest GEMM FP8 rowwise should take over: tokens is M for a linear, M / experts for a grouped GEMM.

    work: least tokens * K * N (per expert group for a grouped GEMM); for a linear, the least K * N at any M.
    """

    k: int
    n: int
    tokens: int
    work: float = 0.0


# The size rule for GEMMs the measured table (auto_table) does not hold, or on another GPU kind: the
# smallest shapes where FP8 rowwise (quantization included) beat BF16 by auto_table.MIN_SPEEDUP on an
# H200 under torch.compile, read off that table. None: slower than BF16 at every shape measured.
# The measurements behind each threshold: docs/options.md, "Why the defaults are what they are" (`recipe`).
FP8_ROWWISE_MIN: dict[str, MinShape | None] = {
    "linear": MinShape(k=1536, n=1536, tokens=16384, work=1.0e7),  # forward, dgrad and wgrad together
    "grouped": MinShape(k=1024, n=1024, tokens=512, work=2.7e10),  # the routed expert MLP in context
}
# Where FP8_ROWWISE_MIN and WGRAD_BF16_AUTO come from, quoted in every reason.
THRESHOLDS_SOURCE = (f"measured on H200: {auto_table.SHIPPED_NAME} (per GEMM and token count), "
                     "examples/results/step_16B_fp8_h200/ (training steps)")

# fp8_rowwise.wgrad_bf16="auto": the weight-gradient GEMM in BF16 for these kinds (none: the FP8 wgrad pays on
# quantize_once's FP8 rows; the measurements: docs/options.md, "Why the defaults are what they are").
WGRAD_BF16_AUTO = {"linear": False, "grouped": False}


def example_tokens(m) -> tuple[int | None, str]:
    """(M if known, how it was known) for an int, a SymInt from Dynamo's example values, or None."""
    if m is None:
        return None, "M unknown at compile time"
    if isinstance(m, int):
        return m, f"M={m}"
    value = example_int(m)
    if value is not None:
        return value, f"M symbolic, example M={value}"
    return None, "M data-dependent (unknown at compile time)"


def choose_recipe(device: torch.device | str, kind: str, m, k: int, n: int,
                  experts: int | None = None, expected=None, measure: bool = False) -> tuple[str, str]:
    """recipe="auto": ("mxfp8" | "fp8_rowwise" | BF16, reason) for one GEMM.

    kind: "linear" (y = x @ W.T, M tokens) or "grouped" (M routed rows over `experts` groups).
    m: int, SymInt or None; when unknown, the decision rests on K and N and the reason says so.
    expected: for a data-dependent M (rows received by expert parallelism), a callable giving the rows to expect
    (moepass.analysis.routed_rows.ExpectedRows, or None), decided on as if M were that; called only when needed.
    measure: time FP8 against BF16 on this GPU for a shape its shipped table does not hold (the option auto.measure).
    """
    if kind not in FP8_ROWWISE_MIN:
        raise ValueError(f"kind={kind!r} is not one of {sorted(FP8_ROWWISE_MIN)}")
    device = torch.device(device)
    gpu = probe(device, "FP8", "MXFP8 numerics emulated (the reference recipe)")
    if isinstance(gpu, str):
        return "mxfp8", gpu
    cc, arch = gpu.capability, gpu.arch
    if cc[0] >= 10:
        return "mxfp8", f"{arch}: native MXFP8 (block-scaled FP8) tensor cores"
    if cc < (8, 9):
        return BF16, f"left in BF16: {arch} has no FP8 tensor cores"
    if kind == "grouped" and cc[0] != 9:
        return BF16, f"left in BF16: {arch} has no FP8 grouped GEMM (torch._scaled_grouped_mm rowwise needs sm_90)"
    need = FP8_ROWWISE_MIN[kind]
    tokens, how = example_tokens(m)
    expected = expected() if tokens is None and expected is not None else None
    if expected is not None:
        tokens, how = expected.rows, f"M data-dependent, expected M={expected.rows}: {expected.why}"
    per = "tokens"
    if kind == "grouped":
        per = "tokens per expert"
        tokens = None if tokens is None or not experts else tokens // experts
        if tokens is None:  # data dependent, and no expert-parallel exchange upstream to expect a count from
            least = f"only from {need.tokens} tokens per expert" if need else "at no size"
            return BF16, (f"left in BF16: tokens per expert unknown at compile time ({how}); FP8 rowwise grouped "
                          f"GEMMs won on {arch} {least} ({THRESHOLDS_SOURCE})")
    table = auto_table.for_gpu(gpu.name)
    if tokens is not None and table is not None:
        verdict = table.linear(k, n, tokens) if kind == "linear" else table.grouped(k, n, tokens, expected is not None)
        if verdict is not None:
            return _table_decision(verdict, arch, table, how)
    unmeasured = ""
    if tokens is not None and measure and expected is None:  # received rows: static rows would flatter FP8
        verdict, source = measuring.verdict(gpu.name, device, kind, k, n, tokens, experts)
        if verdict is not None:
            return _measured_decision(verdict, arch, source, how)
        unmeasured = f"; {source}"
    if need is None:
        return BF16, (f"left in BF16: FP8 rowwise {kind} GEMMs were slower than BF16 on {arch}; decided by the size "
                      f"rule ({THRESHOLDS_SOURCE}){unmeasured}")
    if kind == "linear":  # the size rule: shapes neither the table nor a measurement decided
        work, least_work = k * n, "K*N"
    else:
        work, least_work = (None if tokens is None else tokens * k * n), f"{per}*K*N"
    small = [f"{name}={value} < {least}" for name, value, least in
             (("K", k, need.k), ("N", n, need.n), (per, tokens, need.tokens)) if value is not None and value < least]
    if work is not None and work < need.work:
        small.append(f"{least_work}={work:.3g} < {need.work:.3g}")
    if small:
        size = f"M*K*N={tokens * k * n:.3g}" if kind == "linear" and tokens is not None else how
        return BF16, (f"left in BF16: too small for FP8 to win on {arch} ({', '.join(small)}; {size}); "
                      f"decided by the size rule, thresholds: {THRESHOLDS_SOURCE}{unmeasured}")
    if expected is not None:  # the size rule was read off static rows, where the quantization fuses into producers
        return BF16, (f"left in BF16: FP8 rowwise was not measured for this expert MLP on rows received by "
                      f"expert parallelism ({how}); `python examples/bench_fp8_gemms.py --received-rows` measures it")
    return "fp8_rowwise", (f"{arch}: FP8 rowwise beats BF16 from K>={need.k}, N>={need.n}, {per}>={need.tokens}, "
                           f"{least_work}>={need.work:.3g}; here K={k} N={n}, {how}; decided by the size rule, "
                           f"thresholds: {THRESHOLDS_SOURCE}{unmeasured}")


def _table_decision(verdict: auto_table.Verdict, arch: str, table: auto_table.AutoTable,
                    how: str) -> tuple[str, str]:
    source = f"decided by the shipped table {table.source}, measured on {table.gpu}"
    if verdict.fp8:
        return "fp8_rowwise", f"{arch}: FP8 rowwise wins here: {verdict.detail} ({how}; {source})"
    need = f"needs >= {auto_table.MIN_SPEEDUP:.2f}x"
    return BF16, f"left in BF16: FP8 rowwise does not pay here: {verdict.detail}; {need} ({how}; {source})"


def _measured_decision(verdict: auto_table.Verdict, arch: str, source: str, how: str) -> tuple[str, str]:
    if verdict.fp8:
        return "fp8_rowwise", f"{arch}: FP8 rowwise wins here: {verdict.detail} ({how}; decided by {source})"
    return BF16, f"left in BF16: FP8 rowwise does not pay here: {verdict.detail} ({how}; decided by {source})"
