"""Where a cold torch.compile of one training step spends its time, per variant, side by side.

    python examples/profile_compile.py --device cuda --flavor 671B --layers 5 \\
        --model-overrides '{"n_dense_layers": 1, "n_routed_experts": 32}' --batch 4 --seq 4096 \\
        --variants inductor,all --out examples/results/compile_time_h200.json

Each variant runs in its own child process with empty Inductor and Triton cache directories (a cold compile, as a
new training job sees it), compiles the model and its loss as one graph (as `moepass bench` does), and runs one
forward+backward. It reports the first step's wall time, the median of the steps after it, peak memory, and torch's own compile-phase timers
(`torch._dynamo.utils.compile_times`: Dynamo tracing, AOTAutograd, Inductor lowering and code generation, waits
for Triton's parallel kernel compilation, autotuning), moepass's passes (their report's ms), and the number of
kernels Inductor generated. The ratio of compile times is the figure; the phases say where the difference is.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

import torch

PHASES = 40  # torch's timers kept per variant, the longest first


def _child(args) -> dict:
    """One variant, in this (fresh) process: compile and run one step, then a second; report the timings."""
    import torch._dynamo.utils as dynamo_utils
    from torch._inductor import metrics

    import moepass
    from moepass.harness.model_spec import ModelSpec
    from moepass.harness.train import with_loss
    from moepass.harness.variants import parse_custom_variant, resolve_variants

    # this child process is the whole program: every variant (Inductor's too) traces EP split sizes in one graph
    torch._dynamo.config.capture_scalar_outputs = True
    device = torch.device(args.device)
    custom = dict(parse_custom_variant(spec) for spec in args.variant_options)
    if args.variant in custom:
        (variant,) = resolve_variants([], json.loads(args.options) if args.options else None,
                                      {args.variant: custom[args.variant]})
    else:
        (variant,) = resolve_variants([args.variant], json.loads(args.options) if args.options else None)
    model = ModelSpec(args.flavor, {"n_layers": args.layers, **json.loads(args.model_overrides)}).build(0, device)
    step = variant.compile(with_loss(model))
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = model.output.out_features
    batch = [torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(2)]
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with moepass.collecting() as report:
        for _ in range(1 + args.timed_steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(*batch).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    phases = []
    for name, values in dynamo_utils.compilation_time_metrics.items():
        phases.append({"phase": name, "calls": len(values), "s": round(sum(values), 3)})
    phases.sort(key=lambda p: -p["s"])
    passes = {p.name: round(p.ms / 1e3, 3) for p in report.pass_totals()} if variant.backend == "moepass" else {}
    step_s = sorted(times[1:])[len(times[1:]) // 2]  # the median step after the compiling one
    return {"variant": variant.name, "first_step_s": round(times[0], 3), "step_s": round(step_s, 4),
            "steps_s": [round(t, 4) for t in times[1:]], "compile_s": round(times[0] - step_s, 3),
            "peak_mem_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "moepass_passes_s": passes,
            "kernels_generated": metrics.generated_kernel_count, "phases": phases[:PHASES],
            "kernel_kinds": _kernel_kinds(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))}


def _kernel_kinds(cache_dir: str | None, top: int = 25) -> list:
    """The Triton kernels in the output code Inductor wrote, counted by what they fuse (their name, numbered
    suffix dropped): which kinds of kernel a variant adds."""
    import collections
    import re

    if not cache_dir or not os.path.isdir(cache_dir):
        return []
    kinds = collections.Counter()
    for path in pathlib.Path(cache_dir).rglob("*.py"):
        text = path.read_text(errors="ignore")
        if "def call(args)" not in text:  # the graph's output code, not a kernel's own module
            continue
        for name in re.findall(r"^def (triton_\w+?)(?:_\d+)?\(", text, re.M):
            kinds[name] += 1
        for name in re.findall(r"^(triton_\w+?)(?:_\d+)? = async_compile\.triton\(", text, re.M):
            kinds[name] += 1
    return [[k, n] for k, n in kinds.most_common(top)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model-overrides", default="{}")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--variants", default="inductor,all")
    p.add_argument("--options", default=None, help="moepass options (JSON) for the moepass variants")
    p.add_argument("--variant-options", action="append", default=[], metavar="LABEL=JSON",
                   help="one more moepass variant: every pass with these options (repeatable)")
    p.add_argument("--timed-steps", type=int, default=3, help="steps after the compiling one (their median is "
                   "the step time subtracted from the first)")
    p.add_argument("--out", default=None)
    p.add_argument("--variant", help=argparse.SUPPRESS)  # set in the child process
    args = p.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(_child(args)), flush=True)
        return
    results = []
    from moepass.harness.variants import parse_custom_variant

    names = args.variants.split(",") + [parse_custom_variant(spec)[0] for spec in args.variant_options]
    for name in names:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
                   "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
            child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", name], env=env,
                                   capture_output=True, text=True)
        lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
        if child.returncode or not lines:
            print(child.stdout[-3000:], child.stderr[-5000:], file=sys.stderr)
            results.append({"variant": name, "error": (child.stderr or child.stdout)[-2000:]})
            continue
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        r = results[-1]
        peak = f", peak {r['peak_mem_bytes'] / 2**30:.1f} GiB" if r["peak_mem_bytes"] else ""
        print(f"{name:>12}: compile {r['compile_s']:7.1f} s (first step {r['first_step_s']:.1f} s, then "
              f"{r['step_s'] * 1e3:.0f} ms{peak}), {r['kernels_generated']} kernels, passes {r['moepass_passes_s']}",
              flush=True)
        for phase in r["phases"][:12]:
            print(f"{'':>14}{phase['s']:9.2f} s  {phase['calls']:>4}x  {phase['phase']}")
        for kind, count in r["kernel_kinds"][:12]:
            print(f"{'':>14}{count:6}  {kind}")
    base = next((r for r in results if r.get("variant") == "inductor" and "compile_s" in r), None)
    for r in results:
        if base and "compile_s" in r:
            r["compile_vs_inductor"] = round(r["compile_s"] / base["compile_s"], 3)
            print(f"{r['variant']:>12}: compile time {r['compile_vs_inductor']:.2f}x Inductor's")
    if args.out:
        from moepass.harness.provenance import provenance

        out = {**provenance("moepass.profile_compile/1", torch.device(args.device), 1),
               "command": shlex.join([sys.executable, *sys.argv]), "results": results}
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
