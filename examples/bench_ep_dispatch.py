"""Expert-parallel round trip, side by side: the standard all-to-all path vs DeepEP dispatch/combine.

Run on one host with N GPUs (N in 2, 4, 8 for DeepEP):

    torchrun --nproc-per-node 2 examples/bench_ep_dispatch.py --out examples/results/ep_dispatch_2xH200.json

Each round trip is what an MoE layer does around its experts (replaced here by the identity, so
only layout, exchange and permutation are timed), forward and backward:
  standard  counts -> all_to_all_single(counts) -> .tolist() splits -> token all_to_all (one row per
            (token, expert) pair) -> expert-major permutation ... inverse permutation -> reverse
            all_to_all -> routing weights -> scatter back to tokens   (models/expert_parallel.py)
  deepep    what the deepep pass emits: moepass::ep_dispatch (one row per (token, destination rank))
            -> ep_expert_major_pairs -> recv_x[pair_row] ... weighted fp32 index_add per received row
            -> moepass::ep_combine
  reference the deepep path's ops with the torch.distributed reference backend (what CPU runs)
By default every path is compiled as a model would be (backend "moepass" with no passes: Inductor plus
moepass's decompositions of its ops); --eager times the ops as they run without torch.compile.
Logical bytes = (token, destination rank) rows x hidden x 2 B, dispatch + combine, as DeepEP counts them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import moepass.backend  # noqa: F401  (the "moepass" backend; Dynamo flags for .tolist() splits)
import moepass.ops  # noqa: F401  (registers torch.ops.moepass.*)
from moepass.harness.profiling import profile_table
from moepass.harness.provenance import git_commit
from moepass.models import expert_parallel as standard_ep
from moepass.ops.ep.dispatch_combine import choose_ep_backend, group_args

SHAPES = {"16B": dict(hidden=2048, experts=64, topk=6), "671B": dict(hidden=7168, experts=256, topk=8),
          "tiny": dict(hidden=64, experts=8, topk=2)}  # tiny: a CPU smoke test of the script itself


def routing(tokens: int, experts: int, topk: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g, device=device)
    weights, ids = scores.topk(topk, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


class StageMarks:
    """Timestamps between the stages of one forward: CUDA events (no sync inside), host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []
        self.mark("start")

    def mark(self, stage: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((stage, event))
        else:
            self.marks.append((stage, time.perf_counter()))

    def stage_ms(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
            return {s: a.elapsed_time(b) for (_, a), (s, b) in zip(self.marks, self.marks[1:])}
        return {s: (b - a) * 1e3 for (_, a), (s, b) in zip(self.marks, self.marks[1:])}


def _mark(marks: StageMarks | None, stage: str) -> None:
    if marks is not None:
        marks.mark(stage)


def standard_round_trip(x, ids, weights, experts, group, marks=None):
    ep_size = dist.get_world_size(group)
    tokens, topk = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of_slot = order // topk
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add(0, flat, torch.ones_like(flat))
    routed = x[token_of_slot]
    _mark(marks, "layout+gather")
    local, _, state = standard_ep.dispatch(routed, counts, group, ep_size)
    _mark(marks, "dispatch (counts a2a, .tolist(), token a2a, expert-major permute)")
    back = standard_ep.combine(local, state, group)  # identity experts
    _mark(marks, "combine (unpermute, reverse a2a)")
    weighted = back.float() * weights.reshape(-1)[order].unsqueeze(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, token_of_slot, weighted).to(x.dtype)
    _mark(marks, "weighted scatter to tokens")
    return out


def deepep_round_trip(x, ids, weights, experts, group, backend, marks=None):
    """What the deepep pass emits around the experts (passes/deepep.py), with identity experts."""
    size, name = group_args(group)
    recv_x, recv_ids, recv_w, _, handle = torch.ops.moepass.ep_dispatch(x, ids, weights, experts, size, name, backend)
    _mark(marks, "ep_dispatch")
    pair_row, pair_slot = torch.ops.moepass.ep_expert_major_pairs(recv_ids, experts // size)
    _mark(marks, "expert-major pairs (argsort, host sync)")
    local = recv_x[pair_row]  # identity experts
    _mark(marks, "gather pair rows")
    weighted = local.float() * recv_w.reshape(-1)[pair_slot].unsqueeze(-1)
    per_row = torch.zeros(recv_x.shape, dtype=torch.float32, device=x.device).index_add(0, pair_row, weighted)
    rows = per_row.to(x.dtype) if backend != "reference" else per_row  # DeepEP combines in the model dtype
    _mark(marks, "weighted sum per received row (fp32 index_add)")
    out = torch.ops.moepass.ep_combine(rows, handle, size, name, backend)
    _mark(marks, "ep_combine")
    return out


def round_trip(path: str):
    """(function(x, ids, weights, experts, group, marks), EP backend it needs or None)."""
    if path == "standard":
        return standard_round_trip, None
    backend = "reference" if path == "reference" else "deepep"
    return (lambda x, ids, weights, experts, group, marks=None:
            deepep_round_trip(x, ids, weights, experts, group, backend, marks)), backend


def compiled(fn):
    # dynamic: receive sizes differ per call; the stage marks (CUDA events) break the graph into stages
    return torch.compile(fn, backend="moepass", options={"passes": []}, dynamic=True)


def stage_breakdown(fwd, device, warmup: int, iters: int) -> dict[str, float]:
    """Median forward time of each stage, slowest rank (a stage waits for its slowest peer).

    Run on the uncompiled ops: CUDA events between stages would split a compiled graph into stages.
    """
    for _ in range(warmup):
        fwd(None)
    runs = []
    for _ in range(iters):
        dist.barrier()
        marks = StageMarks(device)
        fwd(marks)
        runs.append(marks.stage_ms())
    return dict(zip(runs[0], slowest_rank([statistics.median(r[s] for r in runs) for s in runs[0]], device)))


def slowest_rank(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over ranks: a round trip is as slow as its slowest rank."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        marks = StageMarks(device)
        fn()
        marks.mark("run")
        times.append(marks.stage_ms()["run"])
    return slowest_rank([statistics.median(times)], device)[0]


def top_kernels(fn, device: torch.device, iters: int = 3) -> list[dict]:
    """This rank's top kernels by device time over `iters` runs (per run: self_us / iters)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    return [{**r, "self_us_per_run": r["self_us"] / iters} for r in profile_table(prof, device, top=12)]


def rows_to_ranks(ids: torch.Tensor, experts: int, ranks: int) -> int:
    rank_of = ids // (experts // ranks)
    hit = torch.zeros(ids.shape[0], ranks, dtype=torch.bool, device=ids.device).scatter_(1, rank_of, True)
    total = hit.sum().to(torch.int64)
    dist.all_reduce(total)
    return int(total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="16B,671B")
    p.add_argument("--tokens", default="4096,8192,16384", help="tokens per rank")
    p.add_argument("--paths", default="standard,deepep,reference")
    p.add_argument("--eager", action="store_true", help="time the ops without torch.compile")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--breakdown", action="store_true",
                   help="also time each stage of the forward round trip (uncompiled ops)")
    p.add_argument("--profile", action="store_true",
                   help="also record each path's top kernels (fwd+bwd, as timed) from torch.profiler")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (NCCL, DeepEP where installed) or cpu (gloo: checks the script, times nothing useful)")
    args = p.parse_args()

    device = torch.device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    group = dist.group.WORLD
    rows = []
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        backend, why = choose_ep_backend(group, device, s["experts"], "auto")
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, s["hidden"], dtype=torch.bfloat16, device=device, requires_grad=True)
            ids, weights = routing(tokens, s["experts"], s["topk"], seed=1000 * rank + tokens, device=device)
            grad = torch.randn_like(x)
            logical = rows_to_ranks(ids, s["experts"], world) * s["hidden"] * 2 * 2 / world  # per rank
            row = {"shape": shape, **s, "tokens_per_rank": tokens, "ranks": world, "logical_bytes_per_rank": logical}
            for path in args.paths.split(","):
                uncompiled, needs = round_trip(path)
                if needs == "deepep" and backend != "deepep":
                    row["deepep_unavailable"] = why
                    continue
                fn = uncompiled if args.eager else compiled(uncompiled)
                fwd = lambda marks=None, fn=fn: fn(x, ids, weights, s["experts"], group, marks)  # noqa: E731
                fwd_ms = time_ms(lambda: fwd(), device, args.warmup, args.iters)
                fb_ms = time_ms(lambda: fwd().backward(grad), device, args.warmup, args.iters)
                row[f"{path}_fwd_ms"], row[f"{path}_fwd_bwd_ms"] = fwd_ms, fb_ms
                row[f"{path}_fwd_GBps"] = logical / fwd_ms / 1e6
                if args.breakdown:
                    staged = lambda marks, fn=uncompiled: fn(x, ids, weights, s["experts"], group, marks)  # noqa: E731
                    row[f"{path}_fwd_stage_ms"] = stage_breakdown(staged, x.device, args.warmup, args.iters)
                if args.profile:
                    row[f"{path}_fwd_bwd_top_kernels"] = top_kernels(lambda: fwd().backward(grad), device)
            if "deepep_fwd_ms" in row:
                row["speedup_fwd"] = row["standard_fwd_ms"] / row["deepep_fwd_ms"]
                row["speedup_fwd_bwd"] = row["standard_fwd_bwd_ms"] / row["deepep_fwd_bwd_ms"]
            rows.append(row)
            if rank == 0:
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()
                                  if not k.endswith("_top_kernels")}), flush=True)
                for key in (k for k in row if k.endswith("_fwd_stage_ms")):
                    print(f"  {shape} {tokens} {key.removesuffix('_fwd_stage_ms')}: " +
                          ", ".join(f"{stage} {ms:.2f} ms" for stage, ms in row[key].items()), flush=True)
    if rank == 0:
        print(f"\n{'shape':<6}{'tokens':>7}{'std fwd+bwd ms':>16}{'deepep fwd+bwd ms':>19}{'speedup':>9}"
              f"{'std fwd ms':>12}{'deepep fwd ms':>15}{'speedup':>9}")
        for r in rows:
            print(f"{r['shape']:<6}{r['tokens_per_rank']:>7}{r.get('standard_fwd_bwd_ms', 0):>16.2f}"
                  f"{r.get('deepep_fwd_bwd_ms', 0):>19.2f}{r.get('speedup_fwd_bwd', 0):>9.2f}"
                  f"{r.get('standard_fwd_ms', 0):>12.2f}{r.get('deepep_fwd_ms', 0):>15.2f}{r.get('speedup_fwd', 0):>9.2f}")
        if args.out:
            commit = git_commit()["commit"]
            result = {"schema": "moepass.bench_ep_dispatch/3", "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "gpus": world, "torch": torch.__version__, "host": platform.node(), "commit": commit,
                      "command": " ".join(["torchrun", f"--nproc-per-node {world}"] + sys.argv),
                      "ep_backend_choice": why, "compiled": not args.eager, "rows": rows}
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
    from moepass.ops.ep.deepep import release_deepep_buffers

    release_deepep_buffers()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
