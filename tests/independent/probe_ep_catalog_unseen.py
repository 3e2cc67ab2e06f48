"""Probe the `deepep` pass on ep_catalog_unseen's EP blocks, one block at a time on 2 gloo ranks (CPU).

Per block, on every rank:
  eager    the EP block vs ep_catalog.reference (all experts local): is the block itself correct?
  capture  the Dynamo graphs (backend that only records them, moepass's capture flags on), saved to
           /tmp/ep_unseen/<block>_rank<r>.py, with the graph-break count
  deepep   torch.compile(block, backend="moepass", options={"passes": ["deepep"], "inductor": False})
  default  torch.compile(block, backend="moepass")  (every pass, Inductor)
  nodeepep the same without the deepep pass ({"passes": ["grouped_mm", "linear"]}, Inductor): default vs nodeepep
           isolates what the EP rewrite changes from the MXFP8 quantization error
For each compile: regions replaced, all-to-alls left in ops_after, skip reasons, forward output and gradients
(x and every parameter) vs the uncompiled block (max abs diff), and any crash with its traceback. Every rank's
findings go to /tmp/ep_unseen/<block>_rank<r>.json; a summary is printed.

    python tests/independent/probe_ep_catalog_unseen.py [--blocks A,B] [--modes deepep,default] [--timeout 900]
        [--patch FILE]   (a Python file exec'd in every rank first: try a proposed moepass fix without editing it)
        [--catalog ep_catalog]   (the 13 blocks of ep_catalog.py instead: a regression run for a --patch)
Each block runs in fresh processes with a hard timeout (a hang is reported as such, not waited out).
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
import ep_catalog_unseen  # noqa: E402

CATALOGS = {"ep_catalog_unseen": ep_catalog_unseen, "ep_catalog": ep_catalog}
catalog = ep_catalog_unseen  # the blocks probed (rank processes are told which)


def deepep_region(name: str):
    return getattr(catalog, "DEEPEP_REGION", {}).get(name, (catalog.CATALOG[name][1], "ep_catalog 'plain' flag"))

OUT_DIR = Path("/tmp/ep_unseen")
ATOL = RTOL = 2e-2  # bf16 outputs, different summation orders


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example_x(rank: int) -> torch.Tensor:
    return torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)


def forward_backward(fn, block, x, rank):
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    # a random cotangent: a plain .sum() gives stride-0 grads that CPU _grouped_mm's backward rejects
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank))
    (out.float() * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in block.named_parameters() if p.grad is not None}
    return out.detach(), x.grad.detach().clone(), grads


def diff(got, want) -> dict:
    (out, xg, grads), (rout, rxg, rgrads) = got, want
    result = {"out": float((out.float() - rout.float()).abs().max()), "|out|": float(rout.float().abs().max()),
              "x_grad": float((xg.float() - rxg.float()).abs().max()), "|x_grad|": float(rxg.float().abs().max())}
    worst_rel = result["x_grad"] / max(result["|x_grad|"], 1e-6)
    param = {}
    for name in sorted(set(grads) | set(rgrads)):
        if name not in grads or name not in rgrads:
            param[name] = "missing on one side"
            worst_rel = float("inf")
            continue
        d, scale = float((grads[name].float() - rgrads[name].float()).abs().max()), float(rgrads[name].abs().max())
        param[name] = d
        worst_rel = max(worst_rel, d / max(scale, 1e-6))
    result["param_grads"] = param
    result["worst_grad_rel"] = worst_rel
    result["ok"] = bool(torch.allclose(out.float(), rout.float(), atol=ATOL, rtol=RTOL)) and worst_rel <= 1 / 32
    return result


def failure(error: BaseException) -> dict:
    return {"crash": f"{type(error).__name__}: {str(error)[:2000]}", "traceback": traceback.format_exc()[-6000:]}


def check_eager(name, rank, group):
    block = catalog.build(name, group)
    x = example_x(rank)
    got = forward_backward(block, block, x, rank)
    want = forward_backward(lambda t: ep_catalog.reference(block, t), block, x, rank)
    # the reference reads the full weights, not the block's parameters: compare output and x grad only
    d = diff((got[0], got[1], {}), (want[0], want[1], {}))
    return d, got


def capture(name, rank, group) -> dict:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    block = catalog.build(name, group)
    try:
        forward_backward(torch.compile(block, backend=backend), block, example_x(rank), rank)
    except Exception as error:
        return failure(error)
    path = OUT_DIR / f"{name}_rank{rank}.py"
    path.write_text("\n\n".join(f"# ---- graph {i} of {len(graphs)}\n"
                                + gm.print_readable(print_output=False, include_stride=True)
                                for i, gm in enumerate(graphs)))
    a2a = sum(1 for gm in graphs for n in gm.graph.nodes if "all_to_all_single" in str(n.target))
    return {"graphs": len(graphs), "a2a_in_graphs": a2a, "saved": str(path)}


def compile_mode(name, rank, group, eager, options) -> dict:
    import moepass

    torch._dynamo.reset()
    block = catalog.build(name, group)
    result = {}
    with moepass.collecting() as report:
        try:
            compiled = torch.compile(block, backend="moepass", options=options) if options is not None \
                else torch.compile(block, backend="moepass")
            got = forward_backward(compiled, block, example_x(rank), rank)
            result["numerics_vs_uncompiled"] = diff(got, eager)
        except Exception as error:
            result.update(failure(error))
    summary = report.to_dict()
    result["report"] = summary
    passes = summary.get("passes", [])
    deepep = [p for p in passes if p["name"] == "deepep"]
    result["graphs"], result["graph_breaks"] = summary.get("graphs"), summary.get("graph_breaks")
    result["deepep_replaced"] = sum(p["replaced"] for p in deepep)
    result["deepep_skipped"] = [s for p in deepep for s in p["skipped"]]
    result["replaced_by_pass"] = {p["name"]: p["replaced"] for p in passes}
    ops_after = summary.get("ops_after", {})
    result["a2a_left"] = sum(v for k, v in ops_after.items() if "all_to_all_single" in k)
    result["ep_dispatch_after"] = ops_after.get("moepass.ep_dispatch", 0)
    return result, (got if "numerics_vs_uncompiled" in result else None)


MODES = {"deepep": {"passes": ["deepep"], "inductor": False}, "default": None,
         "nodeepep": {"passes": ["grouped_mm", "linear"]}}


def rank_main(rank, world_size, port, name, modes, patch=None, catalog_name="ep_catalog_unseen"):
    global catalog
    catalog = CATALOGS[catalog_name]
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
    entry = {"patch": patch, "deepep_region": deepep_region(name)}
    try:
        entry["eager_vs_reference"], eager = check_eager(name, rank, group)
    except Exception as error:
        entry["eager_vs_reference"], eager = failure(error), None
    if eager is not None:
        entry["capture"] = capture(name, rank, group)
        outputs = {}
        for mode in modes:
            try:
                entry[mode], outputs[mode] = compile_mode(name, rank, group, eager, MODES[mode])
            except Exception as error:
                entry[mode] = failure(error)
            dist.barrier()
        if outputs.get("default") is not None and outputs.get("nodeepep") is not None:
            entry["default_vs_nodeepep"] = diff(outputs["default"], outputs["nodeepep"])
    (OUT_DIR / f"{name}_rank{rank}.json").write_text(json.dumps(entry, indent=1, default=str))
    dist.destroy_process_group()


def run_block(name, modes, timeout, patch=None, catalog_name="ep_catalog_unseen") -> dict | None:
    import torch.multiprocessing as mp

    for r in range(2):
        (OUT_DIR / f"{name}_rank{r}.json").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, 2, port, name, modes, patch, catalog_name)) for r in range(2)]
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
    print(f"\n== {name}   DeepEP region by semantics: {e0['deepep_region']}"
          + (f"   [patched: {e0['patch']}]" if e0.get("patch") else ""))
    for r, e in ranks.items():
        ev = e["eager_vs_reference"]
        print(f"  rank{r} eager vs reference: ok={ev.get('ok')} out {ev.get('out')} x_grad {ev.get('x_grad')}"
              + (f" CRASH {ev['crash'][:300]}" if "crash" in ev else ""))
    cap = e0.get("capture", {})
    print(f"  capture: graphs={cap.get('graphs')} a2a={cap.get('a2a_in_graphs')} {cap.get('crash', '')[:300]}")
    for mode in MODES:
        for r, e in ranks.items():
            m = e.get(mode)
            if m is None:
                continue
            num = m.get("numerics_vs_uncompiled", {})
            print(f"  {mode:7s} rank{r}: replaced={m.get('deepep_replaced')} a2a_left={m.get('a2a_left')} "
                  f"ep_dispatch={m.get('ep_dispatch_after')} graphs={m.get('graphs')} breaks={m.get('graph_breaks')} "
                  f"by_pass={m.get('replaced_by_pass')} ok={num.get('ok')} out={num.get('out')} "
                  f"x_grad={num.get('x_grad')} worst_grad_rel={num.get('worst_grad_rel')}")
            for s in m.get("deepep_skipped", []):
                print(f"      skip [{s.get('node')}]: {s.get('reason')}")
            if "crash" in m:
                print("      CRASH: " + m["crash"][:800].replace("\n", "\n             "))
    for r, e in ranks.items():
        if "default_vs_nodeepep" in e:
            d = e["default_vs_nodeepep"]
            print(f"  default vs nodeepep rank{r}: out {d['out']} x_grad {d['x_grad']} worst_grad_rel {d['worst_grad_rel']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalog", default="ep_catalog_unseen", choices=list(CATALOGS))
    parser.add_argument("--blocks", default=None, help="comma-separated block names (default: all of the catalog)")
    parser.add_argument("--modes", default="deepep,default")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per block before its ranks are killed")
    parser.add_argument("--patch", default=None, help="Python file exec'd in every rank before compiling")
    args = parser.parse_args()
    global catalog
    catalog = CATALOGS[args.catalog]
    names = [n for n in (args.blocks or ",".join(catalog.CATALOG)).split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [n for n in names if n not in catalog.CATALOG] + [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown {unknown}; blocks: {list(catalog.CATALOG)}, modes: {list(MODES)}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in names:  # one block at a time: 2 cores
        ranks = run_block(name, modes, args.timeout, args.patch and str(Path(args.patch).resolve()), args.catalog)
        if ranks is None:
            failed = True
            continue
        summarize(name, ranks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
