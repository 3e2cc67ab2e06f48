"""Capture the Dynamo graphs torchtitan's EP MoE gives a per-block torch.compile, on 2 gloo CPU ranks.

    python tests/realstack/probe_torchtitan.py [--variants 16B-like/none,fsdp/16B-like/none]
                                               [--no-moepass] [--sanity] [--spmd-backend partial_dtensor]

For each variant (flavor x AC none/full/selective, and FSDP2 per block) every rank writes
/tmp/tt_probe/<variant>_rank<r>_g<i>.py (print_readable with strides) and .nodes.txt (the
EP-relevant nodes of the graph and of every HOP body: target, args, kwargs, nn_module_stack,
example_value), then compiles a fresh copy with backend="moepass", options={"passes": ["deepep"]}
and prints the report summary. --sanity compares aot_eager against Inductor per rank.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

OUT = Path("/tmp/tt_probe")
RELEVANT = ("all_to_all_single", "wait_tensor", "tolist", "item", "to", "scatter_", "sum", "deterministic_scatter_add",
            "_grouped_mm", "to_local", "from_local", "local_map", "cumsum", "argsort", "repeat_interleave",
            "index_put", "linear", "tag_activation_checkpoint", "_enter_autocast", "_exit_autocast",
            "all_gather_into_tensor", "reduce_scatter_tensor", "topk", "checkpoint")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else "<no nn_module_stack>"


def _example(node: torch.fx.Node) -> str:
    value = node.meta.get("example_value", "<no example_value>")
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return type(value).__name__ if not isinstance(value, str) else value


def describe_nodes(gm: torch.fx.GraphModule, where: str = "top") -> list[str]:
    """EP-relevant nodes of `gm` and, recursively, of every HOP body it holds as a get_attr submodule."""
    meta = {k: getattr(v, "__qualname__", type(v).__name__) for k, v in gm.meta.items()}
    lines = [f"== {where}: {len(gm.graph.nodes)} nodes, GraphModule.meta {meta}"]
    for node in gm.graph.nodes:
        name = _target_name(node)
        if node.op in ("call_function", "call_method") and any(r == name or r in name for r in RELEVANT):
            lines.append(f"  {node.name} = {node.op} {node.target!r} args={node.args} kwargs={node.kwargs}"
                         f" -> {_example(node)} @ {_module_path(node)}")
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
            users = [f"{u.name}={u.target!r} args={u.args} kwargs={u.kwargs}" for u in node.users]
            lines.append(f"  HOP body {node.target} used by {users}")
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
            lines += describe_nodes(getattr(gm, node.target), f"{where}.{node.target}")
    return lines


def capturing_backend(prefix: str, rank: int, graphs: list):
    from torch._dynamo.backends.debugging import aot_eager

    def capture(gm: torch.fx.GraphModule, example_inputs):
        index = len(graphs)
        graphs.append(gm)
        stem = OUT / f"{prefix}_rank{rank}_g{index}"
        stem.with_suffix(".py").write_text(gm.print_readable(print_output=False, include_stride=True))
        stem.with_suffix(".nodes.txt").write_text("\n".join(describe_nodes(gm)) + "\n")
        # aot_eager runs it: gm.forward would replay checkpoint HOPs through eager torch.utils.checkpoint,
        # which rejects the in-place tokens_per_expert_E.add_ on a body input at recompute.
        return aot_eager(gm, example_inputs)
    return capture


def _build(variant: str, spmd_backend: str):
    from tests.realstack import torchtitan_ep as tt

    parts = variant.split("/")
    if parts[0] == "fsdp":  # spmd_types + FSDP2 is refused by torch 2.13's fully_shard
        return tt.fsdp_per_block(parts[1], ac=parts[2])
    return tt.build_moe(parts[0], ac=parts[1], spmd_backend=spmd_backend)


def run_variant(variant: str, rank: int, args) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import moepass
    from tests.realstack import torchtitan_ep as tt

    prefix = variant.replace("/", "_") + ("" if args.spmd_backend == "spmd_types" or variant.startswith("fsdp")
                                          else f"_{args.spmd_backend}")
    torch._dynamo.reset()
    counters.clear()
    started = time.perf_counter()
    titan = _build(variant, args.spmd_backend)
    graphs: list = []
    tt.compile_blocks(titan, capturing_backend(prefix, rank, graphs))
    tokens, labels = tt.example_batch(titan)
    result = tt.forward_backward(titan, tokens, labels)
    breaks = sum(counters["graph_break"].values())
    print(f"[{variant} r{rank}] capture: {len(graphs)} graph(s), {breaks} graph break(s), "
          f"loss {result.loss.item():.6f}, {time.perf_counter() - started:.1f}s", flush=True)

    moepass_result = None
    if args.moepass:
        torch._dynamo.reset()
        started = time.perf_counter()
        titan = _build(variant, args.spmd_backend)
        with moepass.collecting() as report:
            tt.compile_blocks(titan, "moepass", {"passes": ["deepep"]})
            moepass_result = tt.forward_backward(titan, tokens, labels)
        print(f"[{variant} r{rank}] moepass deepep: loss {moepass_result.loss.item():.6f}, "
              f"{time.perf_counter() - started:.1f}s\n{report.summary()}\n", flush=True)

    if args.sanity:
        torch._dynamo.reset()
        started = time.perf_counter()
        reference = tt.train_steps(_build(variant, args.spmd_backend), "aot_eager", steps=1)[0]
        torch._dynamo.reset()
        inductor = tt.train_steps(_build(variant, args.spmd_backend), "inductor", steps=1)[0]
        print(f"[{variant} r{rank}] sanity aot_eager-vs-inductor: {compare(reference, inductor)}, "
              f"{time.perf_counter() - started:.1f}s", flush=True)
        if moepass_result is not None:
            print(f"[{variant} r{rank}] inductor-vs-moepass: {compare(inductor, moepass_result)}", flush=True)


def compare(reference, candidate) -> str:
    errors = sorted(((candidate.grads[n] - g).norm().item() / (g.norm().item() + 1e-12), n)
                    for n, g in reference.grads.items())
    return (f"loss {reference.loss.item():.6f} vs {candidate.loss.item():.6f}, max |dlogit| "
            f"{(reference.output - candidate.output).abs().max().item():.4g}, same grad names "
            f"{set(reference.grads) == set(candidate.grads)}, worst grad rel-norm errors "
            f"{[(n, round(e, 4)) for e, n in errors[-3:]]}")


def worker(rank: int, port: int, args) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=__import__("datetime").timedelta(seconds=300))
    try:
        for variant in args.variants:
            try:
                run_variant(variant, rank, args)
            except Exception:
                print(f"[{variant} r{rank}] FAILED\n{traceback.format_exc()}", flush=True)
                if args.stop_on_error:
                    raise
    finally:
        dist.destroy_process_group()


def all_variants() -> list[str]:
    from tests.realstack.torchtitan_ep import AC_KINDS, FLAVORS

    return [f"{f}/{ac}" for f in FLAVORS for ac in AC_KINDS] + [f"fsdp/{f}/none" for f in FLAVORS]


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="", help="comma list, e.g. 16B-like/full,fsdp/671B-like/none")
    parser.add_argument("--no-moepass", dest="moepass", action="store_false")
    parser.add_argument("--sanity", action="store_true", help="also compare aot_eager with Inductor")
    parser.add_argument("--spmd-backend", default="spmd_types", choices=("spmd_types", "partial_dtensor"))
    parser.add_argument("--stop-on-error", action="store_true")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds before the ranks are killed")
    args = parser.parse_args()
    args.variants = args.variants.split(",") if args.variants else all_variants()
    OUT.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    context = mp.spawn(worker, args=(_free_port(), args), nprocs=2, join=False)
    deadline = time.monotonic() + args.timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            print(f"timed out after {args.timeout:.0f}s", flush=True)
            return 1
    print(f"total {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
