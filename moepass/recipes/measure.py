"""recipe="auto" on a GEMM the shipped table of this GPU model does not hold: FP8 rowwise timed against BF16 on the
GPU itself, once, and the answer kept on disk.

While a graph compiles, each such GEMM shape is timed at its token count: forward, dgrad and wgrad through moepass's
fp8_rowwise ops (kernel "scaled_mm", run eagerly: the compiled step also fuses the activations' quantization into
their producers, so FP8's margin here is a lower bound) against the same three GEMMs in BF16 (F.linear or
torch._grouped_mm under autograd), with CUDA events, the median of a few runs. The verdict is cached in a JSON file
keyed by what changes the timing, as Inductor keys its autotuning: GPU model, driver, CUDA, torch, torchao and the
source of moepass's FP8-rowwise kernels. `auto.measure: false` turns measuring off (the size rule decides).
A measurement that fails (out of memory, no kernel) is not cached: the size rule decides, and the reason says why.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .auto_table import MIN_SPEEDUP, Verdict

log = logging.getLogger(__name__)

CACHE_ENV = "MOEPASS_CACHE_DIR"  # where the measured verdicts live (default ~/.cache/moepass)
SCHEMA = "moepass.fp8_auto_measured/1"
WARMUP, ITERS = 2, 5  # a few milliseconds a shape: compile time stays close to Inductor's
_KERNEL_SOURCES = pathlib.Path(__file__).parents[1] / "ops" / "lowp" / "fp8_rowwise"


def _driver() -> str:
    try:  # Linux: the loaded kernel module's version, without starting nvidia-smi
        return pathlib.Path("/proc/driver/nvidia/version").read_text().split("Kernel Module", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def cache_key(gpu_name: str) -> dict:
    """What a measured verdict depends on, besides the GEMM's shape."""
    sources = hashlib.sha256()
    for path in sorted(_KERNEL_SOURCES.rglob("*.py")):
        sources.update(path.read_bytes())
    return {"gpu": gpu_name, "driver": _driver(), "cuda": torch.version.cuda, "torch": torch.__version__,
            "torchao": _version("torchao"), "moepass": _version("moepass"), "kernels": sources.hexdigest()[:16]}


def cache_path(gpu_name: str) -> pathlib.Path:
    key = cache_key(gpu_name)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = pathlib.Path(os.environ.get(CACHE_ENV) or pathlib.Path.home() / ".cache" / "moepass")
    return root / "fp8_auto_measured" / f"{digest}.json"


class MeasuredCache:
    """The verdicts measured on one GPU model (and software), one JSON file, written after each new entry."""

    def __init__(self, gpu_name: str):
        self.path, self.key = cache_path(gpu_name), cache_key(gpu_name)
        self.entries: dict[str, dict] = {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("schema") == SCHEMA and data.get("key") == self.key:
                self.entries = data["entries"]
        except (OSError, ValueError, KeyError):
            pass

    def get(self, shape: str) -> dict | None:
        return self.entries.get(shape)

    def put(self, shape: str, entry: dict) -> None:
        self.entries[shape] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"schema": SCHEMA, "key": self.key, "entries": self.entries}, indent=1))
            os.replace(tmp, self.path)  # atomic: ranks compiling at once never read half a file
        except OSError as e:  # a read-only home: keep the verdict for this process only
            log.warning("moepass: could not write the measured FP8 verdicts to %s: %s", self.path, e)


@functools.lru_cache(maxsize=None)
def _cache(gpu_name: str) -> MeasuredCache:
    return MeasuredCache(gpu_name)


def shape_key(kind: str, k: int, n: int, tokens: int, experts: int | None) -> str:
    """tokens: M for a linear, tokens per expert for a grouped GEMM."""
    return f"linear K={k} N={n} M={tokens}" if kind == "linear" else \
        f"grouped E={experts} K={k} N={n} tokens_per_expert={tokens}"


def verdict(gpu_name: str, device: torch.device, kind: str, k: int, n: int, tokens: int,
            experts: int | None) -> tuple[Verdict | None, str]:
    """(the measured verdict, where it came from), or (None, why there is none) when measuring failed."""
    cache, shape = _cache(gpu_name), shape_key(kind, k, n, tokens, experts)
    entry = cache.get(shape)
    source = f"measured on this {gpu_name}, cached in {cache.path}"
    if entry is None:
        began = time.perf_counter()
        try:  # real tensors, even where a pass runs under a compile's fake mode (the Inductor route)
            with unset_fake_temporarily():
                bf16_ms, fp8_ms = (measure_linear(device, tokens, k, n) if kind == "linear"
                                   else measure_grouped(device, experts, tokens, k, n))
        except Exception as e:  # noqa: BLE001 - out of memory, no kernel: the size rule decides, saying why
            return None, f"measuring it on this GPU failed ({type(e).__name__}: {str(e)[:160]})"
        entry = {"bf16_ms": round(bf16_ms, 4), "fp8_ms": round(fp8_ms, 4), "speedup": round(bf16_ms / fp8_ms, 3),
                 "seconds": round(time.perf_counter() - began, 2)}
        cache.put(shape, entry)
        source = f"measured on this {gpu_name} now ({entry['seconds']} s), cached in {cache.path}"
    detail = (f"{shape}: FP8 rowwise {entry['fp8_ms']:.3f} ms vs BF16 {entry['bf16_ms']:.3f} ms fwd+dgrad+wgrad, "
              f"{entry['speedup']:.2f}x (needs >= {MIN_SPEEDUP:.2f}x)")
    return Verdict(entry["speedup"], detail), source


def median_ms(fn, warmup: int = WARMUP, iters: int = ITERS) -> float:
    """Median CUDA-event time of fn() over `iters` runs after `warmup`, back to back as in a training step."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _fwd_bwd(gemm, *leaves, grad_out):
    return lambda: torch.autograd.grad(gemm(), leaves, grad_out)


def measure_linear(device: torch.device, m: int, k: int, n: int) -> tuple[float, float]:
    """(BF16 ms, FP8-rowwise ms) of y = x @ W.T, its dgrad and its wgrad at M tokens."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5).requires_grad_()
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    fp8 = torch.ops.moepass.fp8_rowwise_linear
    with torch.enable_grad():
        return (median_ms(_fwd_bwd(lambda: F.linear(x, w), x, w, grad_out=g)),
                median_ms(_fwd_bwd(lambda: fp8(x, w, None, False, "scaled_mm"), x, w, grad_out=g)))


def measure_grouped(device: torch.device, experts: int, tokens_per_expert: int, k: int, n: int) -> tuple[float, float]:
    """(BF16 ms, FP8-rowwise ms) of an expert GEMM x[M, K] @ w_t[E, K, N], its dgrad and wgrad, evenly routed."""
    m = experts * tokens_per_expert
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(experts, n, k, device=device, dtype=torch.bfloat16) * k ** -0.5).requires_grad_()  # [E, N, K]
    offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * tokens_per_expert
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    fp8 = torch.ops.moepass.fp8_rowwise_grouped_mm
    with torch.enable_grad():
        return (median_ms(_fwd_bwd(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), x, w, grad_out=g)),
                median_ms(_fwd_bwd(lambda: fp8(x, w.transpose(-2, -1), offs, False, "scaled_mm"), x, w,
                                    grad_out=g)))
