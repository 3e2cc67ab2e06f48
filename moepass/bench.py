"""`moepass bench`: train one model per variant (eager, Inductor, each pass, all passes) and compare speed.

Every variant starts from the same weights (rebuilt from the same seed) and sees the same batches.
Timing excludes the warm-up steps; compile time is what the warm-up steps took beyond the median
timed step. Under torchrun each rank trains its own batches (experts sharded when --ep > 1, the
other weights' gradients all-reduced), a step lasts as long as its slowest rank, and rank 0 reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import traceback

import torch
import torch.distributed as dist

SCHEMA = "moepass.bench/1"
BASELINE = "inductor"
COMPILE_S_METHOD = ("sum over warm-up steps of (step time - median timed step time); Inductor's on-disk caches "
                    "(on by default) can serve a repeated compile")


def say(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, flush=True)


# ---------------------------------------------------------------- variants


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the same training step: eager, or torch.compile with a backend and options."""

    name: str
    backend: str | None  # None: eager, no torch.compile
    options: dict | None = None

    def compile(self, model: torch.nn.Module):
        if self.backend is None:
            return model
        kwargs = {"options": dict(self.options)} if self.options is not None else {}
        return torch.compile(model, backend=self.backend, **kwargs)


def variant_names() -> list[str]:
    from .options import PIPELINE

    return ["eager", "inductor", *PIPELINE, "all"]


def default_variant_names(ep: int) -> list[str]:
    names = ["inductor", "mxfp8_grouped_mm", "mxfp8_linear", "all"]
    return names[:1] + ["deepep"] + names[1:] if ep > 1 else names


def resolve_variants(names: list[str], options: dict | None = None,
                     custom: dict[str, dict] | None = None) -> list[Variant]:
    """Variant names -> Variants; `options` (user backend options) go to every moepass variant.

    "moepass" is another name for "all" (every pass), the name `moepass converge` reports under.
    `custom`: {label: options} adds moepass variants after the named ones, each running every pass (or
    its own "passes") with `options` updated by its own, to A/B options side by side in one run.
    """
    from .options import PIPELINE, Config

    options = dict(options or {})
    Config.from_options(options)  # a bad --options fails here, before any model is built
    known = [*variant_names(), "moepass"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"moepass: unknown variant(s) {unknown}; valid variants: {known}")
    clash = [label for label in custom or {} if label in known or label in names]
    if len(set(names)) != len(names) or clash:
        raise ValueError(f"moepass: variant listed twice in {names + list(custom or {})}"
                         + (f" ({clash} {'is a' if len(clash) == 1 else 'are'} built-in name(s))" if clash else ""))
    out = []
    for n in names:
        if n == "eager":
            out.append(Variant(n, None))
        elif n == "inductor":
            out.append(Variant(n, "inductor"))
        else:
            passes = list(PIPELINE) if n in ("all", "moepass") else [n]
            out.append(Variant(n, "moepass", {**options, "passes": passes}))
    for label, own in (custom or {}).items():
        merged = {"passes": list(PIPELINE), **options, **own}
        Config.from_options(merged)
        out.append(Variant(label, "moepass", merged))
    return out


def parse_custom_variant(spec: str) -> tuple[str, dict]:
    """--variant LABEL=JSON -> (LABEL, options)."""
    label, sep, text = spec.partition("=")
    try:
        own = json.loads(text) if sep else None
    except json.JSONDecodeError as e:
        own, why = None, f": {e}"
    else:
        why = ""
    if not label.strip() or not isinstance(own, dict):
        raise ValueError(f"moepass: --variant {spec!r} must be LABEL=JSON-object, e.g. "
                         f"'wgrad_bf16={{\"fp8_rowwise.wgrad_bf16\": true}}'{why}")
    return label.strip(), own


# ---------------------------------------------------------------- model and ranks


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A models/ flavor with overrides, or a user factory `module:function` called with the overrides."""

    flavor: str = "debug"
    overrides: dict = dataclasses.field(default_factory=dict)
    factory: str | None = None

    def describe(self) -> dict:
        return {"factory" if self.factory else "flavor": self.factory or self.flavor, "overrides": self.overrides}

    def build(self, seed: int, device: torch.device, ep_group=None) -> torch.nn.Module:
        """The same initial weights for the same seed: every variant calls this afresh."""
        torch.manual_seed(seed)
        kwargs = dict(self.overrides)
        if ep_group is not None:
            kwargs["ep_group"] = ep_group
        with device:  # allocate on the device directly: large flavors need not fit in host memory twice
            if self.factory:
                module_name, _, fn_name = self.factory.partition(":")
                if not fn_name:
                    raise ValueError(f"moepass: --model {self.factory!r} must be 'module:factory'")
                model = getattr(importlib.import_module(module_name), fn_name)(**kwargs)
            else:
                from moepass.models import build_model

                model = build_model(self.flavor, **kwargs)
        return model.to(device)


@dataclasses.dataclass
class Ranks:
    """This process's place in a torchrun job (a single process is rank 0 of 1, with no group)."""

    rank: int = 0
    world: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    group: object = None  # the default process group under torchrun

    @classmethod
    def from_env(cls, device: str) -> "Ranks":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dev = torch.device(device)
        if world == 1:
            return cls(device=dev)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if dev.type == "cuda":
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dev, dist.group.WORLD)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks (a step lasts as long as its slowest rank)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def sharded_params(model: torch.nn.Module) -> set[int]:
    """ids of parameters that live on one rank only (expert weights under EP): never all-reduced."""
    return {id(p) for m in model.modules() if getattr(m, "ep_size", 1) > 1 for p in m.parameters(recurse=False)}


class AllReduceGradsOptimizer:
    """AdamW whose step first averages the replicated weights' gradients over ranks, in one bucket (as DDP)."""

    def __init__(self, model: torch.nn.Module, lr: float, ranks: Ranks):
        self.inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        sharded = sharded_params(model)
        self.replicated = [p for p in model.parameters() if id(p) not in sharded and p.requires_grad]
        self.ranks = ranks

    def step(self) -> None:
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if grads and self.ranks.world > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat.div_(self.ranks.world)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:  # what an lr schedule adjusts
        return self.inner.param_groups


# ---------------------------------------------------------------- memory


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of one variant: CUDA max allocated, else process peak RSS (Linux VmHWM, reset per variant)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.kind = "cuda_max_memory_allocated"
        elif _proc_status_bytes("VmHWM") is not None and self._can_reset_rss_peak():
            self.kind = "process_peak_rss"
        else:
            self.kind = "process_peak_rss_since_start"  # cannot reset: a lifetime peak, not per variant

    @staticmethod
    def _can_reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the peak RSS (VmHWM) to the current RSS
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "process_peak_rss":
            self._can_reset_rss_peak()

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.kind.startswith("process_peak_rss"):
            return _proc_status_bytes("VmHWM")
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------- profiling


def profile_table(prof, device: torch.device, top: int = 25) -> list[dict]:
    """Top kernels by self time on the device (ops by self CPU time on CPU)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    on_device = device.type != "cpu"

    def self_us(e) -> float:
        if on_device:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    if on_device:  # the kernels themselves, not the CPU ops that launched them nor annotated ranges
        kernels = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
        events = kernels or list(events)
    rows = sorted(events, key=self_us, reverse=True)[:top]
    return [{"name": e.key, "calls": int(e.count), "self_us": self_us(e),
             "total_us": float(getattr(e, "device_time_total", 0.0) if on_device else e.cpu_time_total)}
            for e in rows if self_us(e) > 0]


class StepProfiler:
    """Profiles the last `steps` steps of a run (started and stopped from the train loop's on_step)."""

    def __init__(self, device: torch.device, start_after: int, steps: int):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=acts)
        self.device, self.start_after, self.stop_after = device, start_after, start_after + steps
        self.rows: list[dict] = []

    def on_step(self, step: int) -> None:
        if step == self.start_after - 1:
            self.prof.start()
        elif step == self.stop_after - 1:
            self.prof.stop()
            self.rows = profile_table(self.prof, self.device)


# ---------------------------------------------------------------- one variant


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


def run_variant(variant: Variant, spec: ModelSpec, batches, *, steps: int, warmup: int, lr: float, seed: int,
                ranks: Ranks, ep: int, profile: bool = False, log_every: int = 1) -> dict:
    """Train `variant` for `steps` steps; a failure is recorded (status "failed", error), never raised."""
    import moepass
    from moepass.inspect import graph_break_count
    from moepass.train import train

    entry = {"name": variant.name, "backend": variant.backend or "eager", "options": variant.options,
             "steps": steps, "warmup": warmup}
    memory = PeakMemory(ranks.device)
    profile_steps = 2 if profile else 0
    losses: list[float] = []
    error = None
    try:
        torch._dynamo.reset()  # compile from scratch: no reuse of another variant's graphs
        model = spec.build(seed, ranks.device, ranks.group if ep > 1 else None)
        entry["parameters"] = sum(p.numel() for p in model.parameters())  # this rank's: experts split under EP
        profiler = StepProfiler(ranks.device, steps, profile_steps) if profile else None
        optimizer = AllReduceGradsOptimizer(model, lr, ranks)
        memory.reset()
        total = steps + profile_steps

        def on_step(r) -> None:
            losses.append(r.loss)
            if profiler:
                profiler.on_step(r.step)
            if r.step == 0 or (r.step + 1) % log_every == 0 or r.step + 1 == total:
                phase = "warm-up" if r.step < warmup else "profile" if r.step >= steps else "timed"
                say(f"  {variant.name:<18} step {r.step + 1:>4}/{total}  loss {r.loss:8.4f}  "
                    f"{r.seconds * 1e3:10.1f} ms  ({phase})", ranks.rank)

        breaks = graph_break_count()
        with moepass.collecting() as report, torch._dynamo.config.patch(capture_scalar_outputs=ep > 1):
            results = train(model, variant.compile(model), batches, total, ranks.device, lr=lr,
                            on_step=on_step, optimizer=optimizer)
        entry["graph_breaks"] = graph_break_count() - breaks
        if variant.backend == "moepass":
            entry["graphs"] = len(report.graphs)
            entry["passes"] = {p.name: len(p.rewrites) for p in report.pass_totals()}
        step_s = [r.seconds for r in results[:steps]]
        peak = memory.peak()
        if profiler:
            entry["profile"] = profiler.rows
        del model, optimizer
    except Exception as e:  # noqa: BLE001 - one variant's failure must not stop the others
        error = f"{type(e).__name__}: {e}".strip()
        traceback.print_exc(file=sys.stderr)
        step_s, peak = [], None

    errors = [x for x in ranks.gather(error) if x]
    if errors:
        entry.update(status="failed", error=errors[0][:2000])
        return entry
    step_s = ranks.max(step_s)
    peak = int(max(ranks.max([float(peak or 0)])))
    entry.update(status="ok", losses=losses[:steps], loss_first=losses[0], loss_last=losses[steps - 1],
                 peak_mem_bytes=peak or None, peak_mem_kind=memory.kind)
    entry.update(timing_stats(step_s, warmup, batches[0][0].numel() * ranks.world, ranks.world))
    if variant.backend is None:
        entry["compile_s"] = None  # nothing compiled: warm-up excess is allocator/optimizer start-up
    return entry


def add_speedups(entries: list[dict], baseline: str = BASELINE) -> str | None:
    """speedup = baseline median step time / variant median step time; None where either failed."""
    ok = [e for e in entries if e["status"] == "ok"]
    base = next((e for e in ok if e["name"] == baseline), ok[0] if ok else None)
    for e in entries:
        e["speedup_vs_baseline"] = (base["step_ms_median"] / e["step_ms_median"]
                                    if base is not None and e["status"] == "ok" else None)
    return base["name"] if base else None


# ---------------------------------------------------------------- provenance


def package_version(dist_name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    deep_ep = package_version("deep_ep") or package_version("deep-ep")
    if deep_ep is None:
        try:
            deep_ep = getattr(importlib.import_module("deep_ep"), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - absent or unloadable: report null
            deep_ep = None
    return {"python": platform.python_version(), "torch": torch.__version__, "torchao": package_version("torchao"),
            "deep_ep": deep_ep, "moepass": package_version("moepass"), "cuda": torch.version.cuda}


def hardware(device: torch.device, world: int) -> dict:
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    hw = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "device": device.type,
          "world_size": world}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                  compute_capability=f"{props.major}.{props.minor}")
    return hw


def git_commit() -> dict:
    """The moepass checkout's commit and whether it has uncommitted changes (nulls outside git).

    MOEPASS_COMMIT names the commit where the tree has no .git (e.g. a copy sent to a GPU machine)."""
    if os.environ.get("MOEPASS_COMMIT"):
        return {"commit": os.environ["MOEPASS_COMMIT"], "dirty": None}
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if not dirty.returncode else None}


def provenance(schema: str, device: torch.device, world: int) -> dict:
    git = git_commit()
    return {"schema": schema, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(getattr(sys, "orig_argv", sys.argv)), "commit": git["commit"],
            "commit_dirty": git["dirty"], "hardware": hardware(device, world), "versions": versions()}


# ---------------------------------------------------------------- output


def _fmt_bytes(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def error_summary(error: str, width: int = 110) -> str:
    """One line of an error: Dynamo's 'backend raised:' header joined to the real exception below it."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return text[:width]


def table(entries: list[dict], world: int) -> str:
    head = (f"{'variant':<18} {'status':<7} {'tokens/s median (min-max)':>30} {'tok/s/device':>13} "
            f"{'step ms':>10} {'peak mem':>11} {'compile s':>10} {'speedup':>8}")
    lines = [head, "-" * len(head)]
    for e in entries:
        if e["status"] != "ok":
            lines.append(f"{e['name']:<18} {'FAILED':<7} {error_summary(e['error'])}")
            continue
        tps = f"{e['tokens_per_s_median']:,.0f} ({e['tokens_per_s_min']:,.0f}-{e['tokens_per_s_max']:,.0f})"
        comp = "-" if e["compile_s"] is None else f"{e['compile_s']:.1f}"
        lines.append(f"{e['name']:<18} {'ok':<7} {tps:>30} {e['tokens_per_s_per_device_median']:>13,.0f} "
                     f"{e['step_ms_median']:>10.1f} {_fmt_bytes(e['peak_mem_bytes']):>11} {comp:>10} "
                     f"{e['speedup_vs_baseline']:>7.2f}x")
    if world > 1:
        lines.append(f"tokens/s is the total over {world} ranks; tok/s/device divides it by {world} (as torchtitan)")
    return "\n".join(lines)


def json_safe(x):
    """NaN and infinity (a diverged loss) become null: the file stays valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_outputs(result: dict, out_dir: str, stem: str, plot_fn) -> None:
    """Write <out>/<stem>.json and, when matplotlib is installed, <out>/<stem>.png."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(json_safe(result), f, indent=1, allow_nan=False)
    say(f"wrote {path}")
    png = os.path.join(out_dir, f"{stem}.png")
    if plot_fn(result, png):
        say(f"wrote {png}")
    else:
        say("PNG skipped: matplotlib is not installed (pip install 'moepass[plot]')")


# ---------------------------------------------------------------- command line


def add_model_flags(p: argparse.ArgumentParser, *, batch: int, seq: int) -> None:
    """Which model, on which device, and the batch shape: shared by every command that builds a model."""
    p.add_argument("--flavor", default="debug", help="models/ flavor: debug, 16B, 236B, 671B (default: debug)")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--model-overrides", default=None, help='JSON dict of config overrides, e.g. \'{"dim": 512}\'')
    p.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                   help="a user model instead of a flavor: FACTORY(**overrides[, ep_group=...]) -> "
                        "module mapping tokens [B, S] to logits [B, S, V>=256]")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=batch, help="sequences per step (per rank)")
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batches")


def add_model_arguments(p: argparse.ArgumentParser, *, steps: int, batch: int, seq: int) -> None:
    """Model, data and training flags shared by bench and converge."""
    add_model_flags(p, batch=batch, seq=seq)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", default=None, help="text file or directory (default: the Python stdlib's source)")
    p.add_argument("--options", default=None, help='backend options for moepass variants, as JSON')
    p.add_argument("--log-every", type=int, default=None, help="progress line every k steps")


def model_spec(args) -> ModelSpec:
    overrides = json.loads(args.model_overrides) if args.model_overrides else {}
    if args.layers is not None:
        overrides["n_layers"] = args.layers
    return ModelSpec(args.flavor, overrides, args.model)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=20, batch=4, seq=128)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing (compile happens here)")
    p.add_argument("--variants", default=None,
                   help=f"comma list from {variant_names()} (default: inductor,[deepep with --ep>1,]"
                        "mxfp8_grouped_mm,mxfp8_linear,all)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                   help="an extra moepass variant: every pass with --options updated by JSON (repeatable), "
                        "e.g. 'wgrad_bf16={\"fp8_rowwise.wgrad_bf16\": true}'")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (under torchrun: 1 or WORLD_SIZE)")
    p.add_argument("--profile", action="store_true", help="profile 2 extra steps per variant; the top 25 kernels to JSON")
    p.add_argument("--out", default=".", help="directory for bench.json and bench.png")


def cmd_bench(args) -> int:
    from moepass.data import Batches, load_corpus

    from . import plot

    if not 0 < args.warmup < args.steps:
        raise SystemExit(f"moepass bench: need 0 < --warmup ({args.warmup}) < --steps ({args.steps})")
    names = args.variants.split(",") if args.variants else default_variant_names(args.ep)
    custom = dict(parse_custom_variant(spec) for spec in args.variant)
    if len(custom) != len(args.variant):
        raise SystemExit(f"moepass bench: a --variant label is given twice in {args.variant}")
    variants = resolve_variants([n.strip() for n in names], json.loads(args.options) if args.options else None, custom)
    ranks = Ranks.from_env(args.device)
    if args.ep not in (1, ranks.world):
        raise SystemExit(f"moepass bench: --ep {args.ep} must be 1 or the number of ranks ({ranks.world})")
    spec = model_spec(args)
    train_tokens, _ = load_corpus(args.data)
    # every rank its own batches (rank 0's are those of a single-process run), the same for every variant
    batches = Batches(train_tokens, args.batch, args.seq, seed=args.seed + 7919 * ranks.rank)
    log_every = args.log_every or max(1, args.steps // 10)
    say(f"moepass bench: {spec.describe()} on {ranks.world} x {ranks.device.type}, batch {args.batch} x seq "
        f"{args.seq}, {args.steps} steps ({args.warmup} warm-up), variants {[v.name for v in variants]}", ranks.rank)

    entries = []
    for i, v in enumerate(variants, start=1):
        say(f"[{i}/{len(variants)}] {v.name}: backend={v.backend or 'eager'} options={v.options}", ranks.rank)
        entries.append(run_variant(v, spec, batches, steps=args.steps, warmup=args.warmup, lr=args.lr,
                                   seed=args.seed, ranks=ranks, ep=args.ep, profile=args.profile,
                                   log_every=log_every))
    baseline = add_speedups(entries)
    if ranks.rank == 0:
        say("\n" + table(entries, ranks.world))
        result = provenance(SCHEMA, ranks.device, ranks.world)
        result.update(
            config={"model": spec.describe(), "batch": args.batch, "seq": args.seq, "steps": args.steps,
                    "warmup": args.warmup, "lr": args.lr, "seed": args.seed, "ep": args.ep, "data": args.data,
                    "device": str(ranks.device), "world_size": ranks.world, "profile": args.profile,
                    # the command above is one rank's; torchrun launched it when WORLD_SIZE > 1
                    "launcher": "torchrun" if ranks.world > 1 else None},
            baseline=baseline, compile_s_method=COMPILE_S_METHOD,
            peak_mem_kind=PeakMemory(ranks.device).kind, variants=entries)
        write_outputs(result, args.out, "bench", plot.bench_chart)
    if ranks.world > 1:
        from moepass.ops.ep_deepep import release_deepep_buffers

        dist.barrier()
        release_deepep_buffers()  # DeepEP buffers are collective: free them before the group goes
        dist.destroy_process_group()
    return 0 if all(e["status"] == "ok" for e in entries) else 1

