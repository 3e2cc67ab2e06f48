"""`moepass bench`: train one model per variant (eager, Inductor, each pass, all passes) and compare speed.

Every variant starts from the same weights (rebuilt from the same seed) and sees the same batches.
Timing excludes the warm-up steps; compile time is what the warm-up steps took beyond the median
timed step. Under torchrun each rank trains its own batches (experts sharded when --ep > 1, the
other weights' gradients all-reduced), a step lasts as long as its slowest rank, and rank 0 reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch
import torch.distributed as dist

from ..report.collect import collecting
from . import plot
from .corpus import Batches, load_corpus
from .flags import add_model_arguments, model_spec
from .memory import PeakMemory
from .model_spec import ModelSpec
from .output import error_summary, say, write_json, write_outputs
from .profiling import StepProfiler
from .provenance import provenance
from .ranks import AllReduceGradsOptimizer, Ranks
from .timing import COMPILE_S_METHOD, add_speedups, timing_stats
from .train import optimizer_name, train, with_loss
from .variants import Variant, default_variant_names, parse_custom_variant, resolve_variants, variant_names

SCHEMA = "moepass.bench/1"


def run_variant(variant: Variant, spec: ModelSpec, batches, *, steps: int, warmup: int, lr: float, seed: int,
                ranks: Ranks, ep: int, profile: int = 0, log_every: int = 1) -> dict:
    """Train `variant` for `steps` steps; a failure is recorded (status "failed", error), never raised.

    profile: when > 0, 2 more steps run under the profiler and their top `profile` kernels go to the entry.
    """
    entry = {"name": variant.name, "backend": variant.backend or "eager", "options": variant.options,
             "steps": steps, "warmup": warmup}
    if variant.peer:
        entry["peer"] = variant.peer
    unavailable = variant.problem(ranks.device)
    if unavailable:  # the same device kind on every rank: all ranks skip it alike
        say(f"  {variant.name}: not run: {unavailable}", ranks.rank)
        entry.update(status="unavailable", error=unavailable)
        return entry
    memory = PeakMemory(ranks.device)
    profile_steps = 2 if profile else 0
    losses: list[float] = []
    error = None
    try:
        torch._dynamo.reset()  # compile from scratch: no reuse of another variant's graphs
        model = spec.build(seed, ranks.device, ranks.group if ep > 1 else None)
        entry["parameters"] = sum(p.numel() for p in model.parameters())  # this rank's: experts split under EP
        converted = variant.prepare(model)
        if converted:
            entry["converted"] = converted
        profiler = StepProfiler(ranks.device, steps, profile_steps, top=profile) if profile else None
        optimizer = AllReduceGradsOptimizer(model, lr, ranks)
        memory.reset()
        total = steps + profile_steps

        def on_step(r) -> None:
            losses.append(r.loss)
            if profiler:
                profiler.on_step(r.step)
            if r.step == 0 or (r.step + 1) % log_every == 0 or r.step + 1 == total:
                phase = "warm-up" if r.step < warmup else "profile" if r.step >= steps else "timed"
                say(f"  {variant.name:<19} step {r.step + 1:>4}/{total}  loss {r.loss:8.4f}  "
                    f"{r.seconds * 1e3:10.1f} ms  ({phase})", ranks.rank)

        # the loss is compiled with the model (one graph, as a training stack compiles it), in every variant; the bench
        # is the whole program: its EP variants (Inductor's too) trace split sizes in one graph, for this block only
        with collecting() as report, torch._dynamo.config.patch(capture_scalar_outputs=ep > 1):
            results = train(model, variant.compile(with_loss(model)), batches, total, ranks.device, lr=lr,
                            on_step=on_step, optimizer=optimizer, loss_included=True)
        entry["graph_breaks"], entry["frames_run_eagerly"] = report.graph_breaks, report.frames_eager
        if variant.backend == "moepass":
            entry["graphs"] = len(report.graphs)
            entry["passes"] = {p.name: len(p.rewrites) for p in report.pass_totals()}
        step_s = [r.seconds for r in results[:steps]]
        peak = memory.peak()
        last = results[steps - 1]  # a timed step: what a steady-state step holds at the forward's end
        if last.allocated_before_forward is not None:
            entry["memory_before_forward_bytes"] = last.allocated_before_forward
            entry["kept_for_backward_bytes"] = last.allocated_after_forward - last.allocated_before_forward
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


def _bench_result(result: dict, args, spec: ModelSpec, ranks: Ranks, entries: list[dict], complete: bool) -> dict:
    """The bench JSON: provenance, config and the variants measured so far (complete: all of them)."""
    baseline = add_speedups(entries)
    result.update(
        config={"model": spec.describe(), "batch": args.batch, "seq": args.seq, "steps": args.steps,
                "warmup": args.warmup, "lr": args.lr, "seed": args.seed, "ep": args.ep, "data": args.data,
                "device": str(ranks.device), "world_size": ranks.world, "profile": args.profile,
                "optimizer": optimizer_name(ranks.device),
                # the command above is one rank's; torchrun launched it when WORLD_SIZE > 1
                "launcher": "torchrun" if ranks.world > 1 else None},
        baseline=baseline, compile_s_method=COMPILE_S_METHOD,
        peak_mem_kind=PeakMemory(ranks.device).kind, variants=entries, complete=complete)
    return result


def _fmt_bytes(n: int | None) -> str:
    return "-" if not n else f"{n / 2**20:,.0f} MiB"


def table(entries: list[dict], world: int) -> str:
    head = (f"{'variant':<19} {'status':<7} {'tokens/s median (min-max)':>30} {'tok/s/device':>13} "
            f"{'step ms':>10} {'peak mem':>11} {'compile s':>10} {'speedup':>8}")
    lines = [head, "-" * len(head)]
    for e in entries:
        if e["status"] != "ok":
            status = "n/a" if e["status"] == "unavailable" else "FAILED"
            lines.append(f"{e['name']:<19} {status:<7} {error_summary(e['error'])}")
            continue
        tps = f"{e['tokens_per_s_median']:,.0f} ({e['tokens_per_s_min']:,.0f}-{e['tokens_per_s_max']:,.0f})"
        comp = "-" if e["compile_s"] is None else f"{e['compile_s']:.1f}"
        lines.append(f"{e['name']:<19} {'ok':<7} {tps:>30} {e['tokens_per_s_per_device_median']:>13,.0f} "
                     f"{e['step_ms_median']:>10.1f} {_fmt_bytes(e['peak_mem_bytes']):>11} {comp:>10} "
                     f"{e['speedup_vs_baseline']:>7.2f}x")
    if world > 1:
        lines.append(f"tokens/s is the total over {world} ranks; tok/s/device divides it by {world} (as torchtitan)")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, steps=20, batch=4, seq=128)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing (compile happens here)")
    p.add_argument("--variants", default=None,
                   help=f"comma list from {variant_names()} (default: inductor,[deepep with --ep>1,]"
                        "grouped_mm,linear,all; the old names mxfp8_grouped_mm, mxfp8_linear still work)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                   help="an extra moepass variant: the default passes with --options updated by JSON (repeatable), "
                        "e.g. 'wgrad_bf16={\"fp8_rowwise.wgrad_bf16\": true}'")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (under torchrun: 1 or WORLD_SIZE)")
    p.add_argument("--profile", action="store_true", help="profile 2 extra steps per variant; the top kernels to JSON")
    p.add_argument("--profile-top", type=int, default=25, metavar="N",
                   help="how many kernels --profile keeps, by device time (a large N lists every kernel)")
    p.add_argument("--out", default=".", help="directory for bench.json and bench.png")


def cmd_bench(args) -> int:
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

    result = provenance(SCHEMA, ranks.device, ranks.world) if ranks.rank == 0 else None
    entries = []
    for i, v in enumerate(variants, start=1):
        say(f"[{i}/{len(variants)}] {v.name}: backend={v.backend or 'eager'} options={v.options}", ranks.rank)
        entries.append(run_variant(v, spec, batches, steps=args.steps, warmup=args.warmup, lr=args.lr,
                                   seed=args.seed, ranks=ranks, ep=args.ep, log_every=log_every,
                                   profile=args.profile_top if args.profile else 0))
        if result is not None and i < len(variants):  # a run cut short (a time limit) keeps what it measured
            write_json(_bench_result(result, args, spec, ranks, entries, complete=False), args.out, "bench")
    if result is not None:
        result = _bench_result(result, args, spec, ranks, entries, complete=True)
        say("\n" + table(entries, ranks.world))
        write_outputs(result, args.out, "bench", plot.bench_chart)
    if ranks.world > 1:
        from moepass.ops.ep.deepep import release_deepep_buffers

        dist.barrier()
        release_deepep_buffers()  # DeepEP buffers are collective: free them before the group goes
        dist.destroy_process_group()
    return 0 if all(e["status"] in ("ok", "unavailable") for e in entries) else 1  # unavailable: recorded why
