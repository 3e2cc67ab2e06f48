"""Probe the `deepep` pass on ep_catalog_bounded's EP blocks (bounded-length bincount counts), 2 gloo ranks (CPU).

Per block, on every rank:
  eager    the EP block vs ep_catalog.reference (all experts local): is the block itself correct?
  capture  the Dynamo graph with fullgraph=True (backend that only records it, moepass's capture flags on), saved
           to /tmp/ep_bounded/<block>_rank<r>.py, with the length of every bincount's output as Dynamo sees it
           (an unbacked symbol such as u0 when the counts are only bounded)
  deepep   torch.compile(block, backend="moepass", options={"passes": ["deepep"], "inductor": False}, fullgraph=True)
  deepep_inductor  the same with Inductor ({"passes": ["deepep"]})
  default  torch.compile(block, backend="moepass", fullgraph=True)  (every pass, Inductor)
For each compile: regions replaced, all-to-alls left in ops_after, skip reasons, forward output and gradients
(x and every parameter) vs the uncompiled block (max abs diff), and any crash with its traceback. Every rank's
findings go to /tmp/ep_bounded/<block>_rank<r>.json; a summary is printed.

    python tests/independent/probe_ep_catalog_bounded.py [--blocks A,B] [--modes deepep,default] [--timeout 900]
        [--patch FILE]   (a Python file exec'd in every rank first: try a proposed moepass fix without editing it)
Each block runs in fresh processes with a hard timeout (a hang is reported as such, not waited out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import ep_catalog  # noqa: E402
import ep_catalog_bounded as catalog  # noqa: E402
# the block-independent helpers of the unseen catalog's probe
from probe_ep_catalog_unseen import diff, example_x, failure, forward_backward, free_port  # noqa: E402

OUT_DIR = Path("/tmp/ep_bounded")
MODES = {"deepep": {"passes": ["deepep"], "inductor": False}, "deepep_inductor": {"passes": ["deepep"]},
         "default": None}


def check_eager(name, rank, group):
    block = catalog.build(name, group)
    x = example_x(rank)
    got = forward_backward(block, block, x, rank)
    want = forward_backward(lambda t: ep_catalog.reference(block, t), block, x, rank)
    # the reference reads the full weights, not the block's parameters: compare output and x grad only
    return diff((got[0], got[1], {}), (want[0], want[1], {})), got


def counts_lengths(gm: torch.fx.GraphModule) -> list[str]:
    """The output length of every bincount / histc / scatter_add in the graph, as Dynamo sees it."""
    lengths = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method") and any(
                k in str(node.target) for k in ("bincount", "histc", "scatter_add")):
            val = node.meta.get("example_value")
            if isinstance(val, torch.Tensor) and val.dim() == 1:
                lengths.append(f"{node.name}: {val.shape[0]}")
    return lengths


def capture(name, rank, group) -> dict:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    block = catalog.build(name, group)
    try:
        forward_backward(torch.compile(block, backend=backend, fullgraph=True), block, example_x(rank), rank)
    except Exception as error:
        return failure(error)
    path = OUT_DIR / f"{name}_rank{rank}.py"
    path.write_text("\n\n".join(f"# ---- graph {i} of {len(graphs)}\n"
                                + gm.print_readable(print_output=False, include_stride=True)
                                for i, gm in enumerate(graphs)))
    a2a = sum(1 for gm in graphs for n in gm.graph.nodes if "all_to_all_single" in str(n.target))
    return {"graphs": len(graphs), "a2a_in_graphs": a2a, "counts_lengths": [c for gm in graphs
                                                                          for c in counts_lengths(gm)],
            "saved": str(path)}


def compile_mode(name, rank, group, eager, options) -> tuple[dict, tuple | None]:
    import moepass

    torch._dynamo.reset()
    block = catalog.build(name, group)
    result, got = {}, None
    with moepass.collecting() as report:
        try:
            kwargs = {} if options is None else {"options": options}
            compiled = torch.compile(block, backend="moepass", fullgraph=True, **kwargs)
            got = forward_backward(compiled, block, example_x(rank), rank)
            result["numerics_vs_uncompiled"] = diff(got, eager)
        except Exception as error:
            result.update(failure(error))
    summary = report.to_dict()
    passes = summary.get("passes", [])
    deepep = [p for p in passes if p["name"] == "deepep"]
    result["graphs"], result["graph_breaks"] = summary.get("graphs"), summary.get("graph_breaks")
    result["deepep_replaced"] = sum(p["replaced"] for p in deepep)
    result["deepep_skipped"] = [s for p in deepep for s in p["skipped"]]
    result["deepep_rewrites"] = [r for p in deepep for r in p.get("rewrites", [])]
    result["replaced_by_pass"] = {p["name"]: p["replaced"] for p in passes}
    ops_after = summary.get("ops_after", {})
    result["a2a_left"] = sum(v for k, v in ops_after.items() if "all_to_all_single" in k)
    result["ep_dispatch_after"] = ops_after.get("moepass.ep_dispatch", 0)
    return result, got


def rank_main(rank, world_size, port, name, modes, patch=None):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    import moepass.backend  # noqa: F401  (the backend compared below; importing it sets no Dynamo flag)

    # this probe process is the whole program: its own capturing backends need what moepass turns on for its frames
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    if patch:
        exec(compile(Path(patch).read_text(), patch, "exec"), {"__name__": "moepass_patch"})
    group = dist.group.WORLD
    entry = {"patch": patch, "deepep_region": catalog.DEEPEP_REGION[name],
             "counts_length": catalog.COUNTS_LENGTH[name]}
    try:
        entry["eager_vs_reference"], eager = check_eager(name, rank, group)
    except Exception as error:
        entry["eager_vs_reference"], eager = failure(error), None
    if eager is not None:
        entry["capture"] = capture(name, rank, group)
        for mode in modes:
            try:
                entry[mode], _ = compile_mode(name, rank, group, eager, MODES[mode])
            except Exception as error:
                entry[mode] = failure(error)
            dist.barrier()
    (OUT_DIR / f"{name}_rank{rank}.json").write_text(json.dumps(entry, indent=1, default=str))
    dist.destroy_process_group()


def run_block(name, modes, timeout, patch=None) -> dict | None:
    import torch.multiprocessing as mp

    for r in range(2):
        (OUT_DIR / f"{name}_rank{r}.json").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, name, modes, patch)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    files = [OUT_DIR / f"{name}_rank{r}.json" for r in range(2)]
    if hung or not all(f.exists() for f in files):
        print(f"== {name}: FAILED (hung ranks={len(hung)}, exit codes={[p.exitcode for p in procs]})", flush=True)
        return None
    return {r: json.loads(f.read_text()) for r, f in enumerate(files)}


def summarize(name, ranks: dict) -> None:
    e0 = ranks[0]
    print(f"\n== {name}   DeepEP region: {e0['deepep_region']}   counts length: {e0['counts_length']}"
          + (f"   [patched: {e0['patch']}]" if e0.get("patch") else ""))
    for r, e in ranks.items():
        ev = e["eager_vs_reference"]
        print(f"  rank{r} eager vs reference: ok={ev.get('ok')} out {ev.get('out')} x_grad {ev.get('x_grad')}"
              + (f" CRASH {ev['crash'][:300]}" if "crash" in ev else ""))
    cap = e0.get("capture", {})
    print(f"  capture (fullgraph): graphs={cap.get('graphs')} a2a={cap.get('a2a_in_graphs')} "
          f"counts lengths={cap.get('counts_lengths')} {cap.get('crash', '')[:600]}")
    for mode in MODES:
        for r, e in ranks.items():
            m = e.get(mode)
            if m is None:
                continue
            num = m.get("numerics_vs_uncompiled", {})
            print(f"  {mode:15s} rank{r}: replaced={m.get('deepep_replaced')} a2a_left={m.get('a2a_left')} "
                  f"ep_dispatch={m.get('ep_dispatch_after')} graphs={m.get('graphs')} breaks={m.get('graph_breaks')} "
                  f"ok={num.get('ok')} out={num.get('out')} x_grad={num.get('x_grad')} "
                  f"worst_grad_rel={num.get('worst_grad_rel')}")
            for w in m.get("deepep_rewrites", []):
                print(f"      rewrite [{w.get('node')}]: {w.get('detail', '')[:400]}")
            for s in m.get("deepep_skipped", []):
                print(f"      skip [{s.get('node')}]: {s.get('reason')}")
            if "crash" in m:
                print("      CRASH: " + m["crash"][:800].replace("\n", "\n             "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default=None, help="comma-separated block names (default: all of the catalog)")
    parser.add_argument("--modes", default="deepep,default")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per block before its ranks are killed")
    parser.add_argument("--patch", default=None, help="Python file exec'd in every rank before compiling")
    args = parser.parse_args()
    names = [n for n in (args.blocks or ",".join(catalog.CATALOG)).split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [n for n in names if n not in catalog.CATALOG] + [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown {unknown}; blocks: {list(catalog.CATALOG)}, modes: {list(MODES)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in names:  # one block at a time: 2 cores
        ranks = run_block(name, modes, args.timeout, args.patch and str(Path(args.patch).resolve()))
        if ranks is None:
            failed = True
            continue
        summarize(name, ranks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
