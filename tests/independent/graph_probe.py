"""Print the pass-relevant nodes of the Dynamo graphs of the independent models.

For each captured graph: linears, grouped GEMMs, collectives, waits and in-place copies, with
target repr, argument forms and the innermost nn_module_stack path. Used to write
.notes/external_models.md and to check a torch version (e.g. 2.11 on the GPU machine)
captures the same shapes: `python tests/independent/graph_probe.py [hf|ep] [outfile]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).parent))
import hf_style_moe as hf  # noqa: E402

RELEVANT = {"linear", "_grouped_mm", "grouped_mm", "all_to_all_single", "wait_tensor", "copy_", "item", "type", "bfloat16",
            "transpose", "to_local", "_enter_autocast", "_exit_autocast"}


def target_name(node: torch.fx.Node) -> str:
    if isinstance(node.target, str):
        return node.target
    if isinstance(node.target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        return node.target._opname if hasattr(node.target, "_opname") else str(node.target).split(".")[-1]
    return getattr(node.target, "__name__", "")


def module_path(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def describe(graphs: list[torch.fx.GraphModule]) -> str:
    lines = [f"torch {torch.__version__}: {len(graphs)} graph(s)",
             f"F.grouped_mm exists: {hasattr(torch.nn.functional, 'grouped_mm')}"]
    for i, gm in enumerate(graphs):
        lines.append(f"== graph {i}: {len(gm.graph.nodes)} nodes")
        for n in gm.graph.nodes:
            if n.op not in ("call_function", "call_method"):
                continue
            if target_name(n) not in RELEVANT:
                continue
            target = repr(n.target)
            value = n.meta.get("example_value")
            dtype = getattr(value, "dtype", "")
            lines.append(f"  {n.name} = {n.op} {target} args={[str(a) for a in n.args]} kwargs={n.kwargs} -> {dtype} @ {module_path(n)}")
    return "\n".join(lines)


def capture(fn, *args) -> list[torch.fx.GraphModule]:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args).backward()
    return graphs


def probe_hf() -> str:
    model = hf.build(seed=0)
    return describe(capture(hf.loss_fn, model, hf.example_input_ids(model.cfg)))


def _probe_ep_rank(rank: int, world_size: int, port: int, outfile: str) -> None:
    import torch.distributed as dist

    import ep_style_moe as ep

    ep.init_gloo(rank, world_size, port)
    # this probe process is the whole program: its capturing backend needs the .tolist() split sizes as SymInts
    torch._dynamo.config.capture_scalar_outputs = True
    report = []
    for count_exchange in ("c10d_inplace", "functional"):
        model = ep.build_ep(dist.group.WORLD, seed=0, count_exchange=count_exchange, num_hidden_layers=2)
        report.append(f"#### count_exchange={count_exchange}")
        report.append(describe(capture(hf.loss_fn, model, hf.example_input_ids(model.cfg, seed=10 + rank))))
    if rank == 0:
        Path(outfile).write_text("\n".join(report) + "\n")
    dist.destroy_process_group()


def probe_ep(outfile: str) -> str:
    import torch.multiprocessing as mp

    import ep_style_moe as ep

    mp.start_processes(_probe_ep_rank, args=(2, ep.free_port(), outfile), nprocs=2, start_method="spawn")
    return Path(outfile).read_text()


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "hf"
    out = sys.argv[2] if len(sys.argv) > 2 else f"/tmp/graph_probe_{which}.txt"
    text = probe_hf() if which == "hf" else probe_ep(out)
    Path(out).write_text(text + "\n")
    print(text)
