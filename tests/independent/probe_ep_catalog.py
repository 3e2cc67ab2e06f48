"""Self-test and graph probe of ep_catalog's EP MoE blocks on 2 gloo ranks (CPU).

Per block, on every rank:
  1. eager: EP output and grad of x == ep_catalog.reference (same block, all experts local);
  2. capture: torch.compile(block, backend=<capturing>, fullgraph=True) with the flags moepass
     turns on for its own frames (capture_scalar_outputs, capture_dynamic_output_shape_ops); the Dynamo graph goes to
     /tmp/ep_catalog/<name>_rank<r>.py; a graph break is recorded (and the graphs of a non-fullgraph
     compile saved instead);
  3. deepep: torch.compile(block, backend="moepass", options={"passes": ["deepep"], "inductor": ...}):
     the pass's replaced count and skip reasons, and whether forward + backward run and match eager.
Rank 0's findings are printed; every rank's go to /tmp/ep_catalog/results_rank<r>.json.

    python tests/independent/probe_ep_catalog.py [--blocks A,B] [--inductor] [--timeout 1200]
Exit status 1 when a block's eager EP output differs from its reference, or a rank hangs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import ep_catalog  # noqa: E402

OUT_DIR = Path("/tmp/ep_catalog")
ATOL = RTOL = 2e-2  # bf16: a few ulps of O(1) values, different summation orders
OPS_OF_INTEREST = ("all_to_all_single", "wait_tensor", "autograd_function_apply", "item", "_local_scalar_dense",
                   "tolist", "histc", "bincount", "one_hot", "scatter", "scatter_add", "scatter_reduce",
                   "scatter_add_rows", "index_add", "index_put", "index_copy", "index_select", "masked_select",
                   "repeat_interleave", "sort", "argsort", "split", "copy_", "setitem", "_grouped_mm",
                   "sym_constrain_range", "_assert_scalar")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example_x(rank: int) -> torch.Tensor:
    return torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)


def forward_backward(fn, x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    # a random cotangent: a plain .sum() gives stride-0 grads that CPU _grouped_mm's backward rejects
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))
    (out.float() * g).sum().backward()
    return out.detach(), x.grad.detach()


def compare(got, want) -> dict:
    (out, grad), (ref_out, ref_grad) = got, want
    ok = torch.allclose(out.float(), ref_out.float(), atol=ATOL, rtol=RTOL) and \
        torch.allclose(grad.float(), ref_grad.float(), atol=ATOL, rtol=RTOL)
    return {"ok": bool(ok), "max_err_out": float((out.float() - ref_out.float()).abs().max()),
            "max_err_grad": float((grad.float() - ref_grad.float()).abs().max()),
            "max_abs_out": float(ref_out.float().abs().max())}


def op_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return getattr(t, "_opname", None) or getattr(t, "__name__", None) or str(t)


def interesting_ops(graphs) -> dict:
    counts = {}
    for gm in graphs:
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method"):
                name = op_name(n)
                if name in OPS_OF_INTEREST or name.rstrip("_") in OPS_OF_INTEREST:
                    counts[name] = counts.get(name, 0) + 1
    return counts


def short(error: BaseException, lines: int = 6) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return "\n".join(text[:lines])


def check_eager(name: str, rank: int, group) -> dict:
    block = ep_catalog.build(name, group)
    x = example_x(rank)
    got = forward_backward(block, x, rank)
    want = forward_backward(lambda t: ep_catalog.reference(block, t), x, rank)
    result = compare(got, want) | {"eager_out": got}
    if block.capacity is not None or block.combine != "sum":
        # the example must exercise what makes the block non-plain: slots dropped, or rows averaged
        block.capacity, block.combine = None, "sum"
        plain = forward_backward(lambda t: ep_catalog.reference(block, t), x, rank)
        result["differs_from_plain"] = not compare(got, plain)["ok"]
        result["ok"] = result["ok"] and result["differs_from_plain"]
    return result


def capture(name: str, rank: int, group, eager) -> dict:
    result = {}
    for fullgraph in (True, False):
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        block = ep_catalog.build(name, group)
        try:
            got = forward_backward(torch.compile(block, backend=backend, fullgraph=fullgraph), example_x(rank), rank)
        except Exception as error:  # a graph break under fullgraph=True, or a tracing failure
            result["fullgraph" if fullgraph else "error"] = False
            result["break" if fullgraph else "error_message"] = short(error)
            continue
        result["fullgraph"] = result.get("fullgraph", True)
        result["graphs"] = len(graphs)
        result["matches_eager"] = compare(got, eager)["ok"]
        result["ops"] = interesting_ops(graphs)
        path = OUT_DIR / f"{name}_rank{rank}.py"
        path.write_text("\n\n".join(f"# ---- graph {i} of {len(graphs)} (fullgraph={fullgraph})\n"
                                    + gm.print_readable(print_output=False, include_stride=True)
                                    for i, gm in enumerate(graphs)))
        result["saved"] = str(path)
        break
    return result


def run_deepep(name: str, rank: int, group, eager, inductor: bool) -> dict:
    import moepass

    torch._dynamo.reset()
    block = ep_catalog.build(name, group)
    options = {"passes": ["deepep"], "inductor": inductor}
    result = {}
    with moepass.collecting() as report:
        try:
            got = forward_backward(torch.compile(block, backend="moepass", options=options), example_x(rank), rank)
            result["runs_fwd_bwd"] = True
            result["matches_eager"] = compare(got, eager)
        except Exception as error:
            result["runs_fwd_bwd"] = False
            result["error"] = short(error, 12)
    summary = report.to_dict()
    passes = [p for p in summary.get("passes", []) if p["name"] == "deepep"]
    result["graphs"], result["graph_breaks"] = summary.get("graphs"), summary.get("graph_breaks")
    result["replaced"] = sum(p["replaced"] for p in passes)
    result["skipped"] = [s["reason"] for p in passes for s in p["skipped"]]
    result["rewrites"] = [r.get("detail") for p in passes for r in p.get("rewrites", [])]
    return result


def rank_main(rank: int, world_size: int, port: int, names: list[str], inductor: bool) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=90))
    import moepass.backend  # noqa: F401  (the backend compared below; importing it sets no Dynamo flag)

    # this probe process is the whole program: its own capturing backends need what moepass turns on for its frames
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    group = dist.group.WORLD
    results = {}
    for name in names:
        entry = results[name] = {"plain": ep_catalog.CATALOG[name][1]}
        for step, fn in (("eager", lambda: check_eager(name, rank, group)),
                         ("capture", lambda: capture(name, rank, group, eager_out)),
                         ("deepep", lambda: run_deepep(name, rank, group, eager_out, inductor))):
            try:
                entry[step] = fn()
            except Exception as error:
                entry[step] = {"exception": short(error, 12), "traceback": traceback.format_exc()[-3000:]}
            if step == "eager":
                eager_out = entry["eager"].pop("eager_out", None)
            if eager_out is None:
                break
        dist.barrier()
        if rank == 0:
            print(f"[rank0] {name}: {json.dumps({k: v for k, v in entry.items()}, default=str)[:1500]}", flush=True)
    (OUT_DIR / f"results_rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


def summarize(results: dict, results_1: dict) -> bool:
    all_ok = True
    for name, entry in results.items():
        eager = entry.get("eager", {})
        ok = eager.get("ok", False) and results_1.get(name, {}).get("eager", {}).get("ok", False)
        all_ok &= ok
        cap, dp = entry.get("capture", {}), entry.get("deepep", {})
        print(f"\n== {name} ({'plain' if entry['plain'] else 'NOT plain'})")
        print(f"  eager == reference on both ranks: {ok} (rank0 max err out {eager.get('max_err_out')}, "
              f"grad {eager.get('max_err_grad')}, |out| {eager.get('max_abs_out')})"
              + (f"; differs from the plain semantics: {eager['differs_from_plain']}" if "differs_from_plain" in eager
                 else ""))
        print(f"  fullgraph: {cap.get('fullgraph')}  graphs: {cap.get('graphs')}  matches eager: "
              f"{cap.get('matches_eager')}")
        if cap.get("break"):
            print("  break: " + cap["break"].replace("\n", "\n         "))
        if cap.get("error_message"):
            print("  capture error: " + cap["error_message"].replace("\n", "\n         "))
        print(f"  ops: {cap.get('ops')}")
        print(f"  deepep: replaced={dp.get('replaced')} runs fwd+bwd={dp.get('runs_fwd_bwd')} "
              f"graphs={dp.get('graphs')} breaks={dp.get('graph_breaks')} matches eager="
              f"{(dp.get('matches_eager') or {}).get('ok')}")
        for reason in dp.get("skipped", []):
            print(f"    skip: {reason}")
        for detail in dp.get("rewrites", []):
            print(f"    rewrite: {detail}")
        if dp.get("error") or dp.get("exception"):
            print("    error: " + (dp.get("error") or dp.get("exception")).replace("\n", "\n           "))
    return all_ok


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=",".join(ep_catalog.CATALOG), help="comma-separated block names")
    parser.add_argument("--inductor", action="store_true", help="let the moepass run compile with Inductor")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds before a hung rank fails the run")
    args = parser.parse_args()
    names = [n for n in args.blocks.split(",") if n]
    unknown = [n for n in names if n not in ep_catalog.CATALOG]
    if unknown:
        parser.error(f"unknown blocks {unknown}; known: {list(ep_catalog.CATALOG)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for r in range(2):
        (OUT_DIR / f"results_rank{r}.json").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, names, args.inductor)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=args.timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if hung or any(p.exitcode for p in procs):
        print(f"FAILED: ranks hung={len(hung)} exit codes={[p.exitcode for p in procs]}")
        return 1
    results = [json.loads((OUT_DIR / f"results_rank{r}.json").read_text()) for r in range(2)]
    ok = summarize(results[0], results[1])
    print(f"\nself-test: {'every block == its non-EP reference' if ok else 'MISMATCH (see above)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
