"""Real DeepEP against the deep_ep double moepass's CI runs on (tests/fixtures/doubles/deep_ep), output for output.

    torchrun --nproc-per-node 2 examples/compare_deepep_double.py --out examples/results/deepep_double_2xH200

On the same inputs every rank runs both implementations of deep_ep.Buffer (V1, normal mode) and compares:
get_dispatch_layout; dispatch with a new layout (received rows and their order, recv_topk_idx, recv_topk_weights, the
per-expert counts, every handle tensor); dispatch with that handle; combine without weights and with topk_weights;
the FP8 tuple (e4m3 rows, fp32 [T, H/128] scales) with and without the handle; the handle's head tensors after the
combines (DeepEP rewrites them in place). Rows, ids, counts and handles must be equal; combined sums equal, or
within fp32 rounding where a token's sum has more than two terms (the detail says which). Across nodes DeepEP numbers
send_nvl_head in arrival order, so there only its -1 pattern is compared. Rank 0 prints a table and writes
<out>/compare.json (GPU, torch, deep_ep, commit, command, every row). --impl-a / --impl-b: "deep_ep" (installed) or
"double"; --device cpu runs on gloo (double against double: what tests/integration/test_deepep_double.py does).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOUBLE = os.path.join(REPO, "tests", "doubles", "deep_ep")
INTRANODE_HANDLE = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                    "is_token_in_rank", "send_head")
INTERNODE_HANDLE = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                    "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
SUMS = {"combine.x", "combine_weighted.x", "combine.topk_weights"}  # a sum per token: equal up to fp32 rounding


def load_implementation(name: str):
    """The installed deep_ep, or the double (loaded as `deep_ep_double`, so both can live in one process)."""
    if name == "deep_ep":
        import deep_ep

        return deep_ep
    spec = importlib.util.spec_from_file_location("deep_ep_double", os.path.join(DOUBLE, "__init__.py"),
                                                  submodule_search_locations=[DOUBLE])
    module = importlib.util.module_from_spec(spec)
    sys.modules["deep_ep_double"] = module
    spec.loader.exec_module(module)
    return module


def make_inputs(rank: int, device, hidden: int, num_tokens: int, num_experts: int, num_topk: int, seed: int) -> dict:
    """This rank's tokens and routing: token 0 routed nowhere, about a sixth of the other slots -1."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(num_tokens, hidden, generator=gen)
    topk_idx = torch.rand(num_tokens, num_experts, generator=gen).topk(num_topk).indices
    topk_idx = torch.where(torch.rand(num_tokens, num_topk, generator=gen) < 1 / 6, -1, topk_idx)
    topk_idx[0] = -1
    scales = torch.rand(num_tokens, hidden // 128, generator=gen) + 0.5
    return dict(x=x.to(torch.bfloat16).to(device), topk_idx=topk_idx.to(device),
                topk_weights=torch.rand(num_tokens, num_topk, generator=gen).to(device),
                x_q=(x / 4).to(torch.float8_e4m3fn).to(device), x_scales=scales.to(device))


def run(deep_ep, group, inputs: dict, num_experts: int) -> dict:
    """Every output the comparison looks at, from one implementation (copied to the CPU)."""
    world = group.size()
    hidden_bytes = inputs["x"].shape[1] * 2
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, world) for c in configs) if world > 8 else 0
    buffer = deep_ep.Buffer(group, nvl, rdma, explicitly_destroy=True)
    topk_idx = inputs["topk_idx"].to(deep_ep.topk_idx_t)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
        inputs["x"], topk_idx=topk_idx, topk_weights=inputs["topk_weights"], **layout)
    names = INTERNODE_HANDLE if world > 8 else INTRANODE_HANDLE
    out = {"layout.num_tokens_per_rank": per_rank, "layout.num_tokens_per_expert": per_expert,
           "layout.is_token_in_rank": in_rank, "dispatch.recv_x": recv_x, "dispatch.recv_topk_idx": recv_idx,
           "dispatch.recv_topk_weights": recv_w, "dispatch.counts": torch.tensor(counts)}
    if per_rdma is not None:
        out["layout.num_tokens_per_rdma_rank"] = per_rdma
    out.update({f"dispatch.handle.{n}": t.clone() for n, t in zip(names, handle)})
    out["cached_dispatch.recv_x"] = buffer.dispatch((inputs["x"].float() * 3).to(torch.bfloat16), handle=handle)[0]
    y = (recv_x.float() * 1.5 - 0.25).to(torch.bfloat16)  # a per-row function of the rows received
    out["combine.x"] = buffer.combine(y, handle)[0]
    combined, combined_w, _ = buffer.combine(y, handle, topk_weights=(recv_w * 2 - 1).contiguous())
    out["combine_weighted.x"], out["combine.topk_weights"] = combined, combined_w
    out.update({f"combine.handle.{n}": t for n, t in zip(names, handle) if "head" in n})
    fp8 = (inputs["x_q"], inputs["x_scales"])
    (q, s), *_ = buffer.dispatch(fp8, topk_idx=topk_idx, topk_weights=inputs["topk_weights"], **layout)
    out["fp8_dispatch.recv_x"], out["fp8_dispatch.recv_x_scales"] = q, s
    (q, s), *_ = buffer.dispatch(fp8, handle=handle)
    out["fp8_cached_dispatch.recv_x"], out["fp8_cached_dispatch.recv_x_scales"] = q, s
    buffer.destroy()
    return {k: v.detach().cpu() for k, v in out.items()}


def compare_outputs(name: str, a: torch.Tensor, b: torch.Tensor, world: int) -> dict:
    row = {"output": name, "dtype": str(a.dtype).removeprefix("torch."), "shape": list(a.shape)}
    if name.endswith("send_nvl_head"):  # DeepEP numbers these in arrival order: only -1 is fixed
        a, b = a >= 0, b >= 0
        row["compared"] = "-1 pattern"
    if a.shape != b.shape or a.dtype != b.dtype:
        return {**row, "agree": False, "equal": False, "detail": f"{b.dtype} {list(b.shape)} against {a.dtype}"}
    bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)
    if torch.equal(bits(a), bits(b)):
        return {**row, "agree": True, "equal": True, "detail": "equal"}
    if name in SUMS:  # fp32 sums of up to `world` terms, then the output dtype
        diff = (a.float() - b.float()).abs()
        ulp = torch.finfo(a.dtype).eps if a.dtype != torch.float32 else world * torch.finfo(torch.float32).eps
        within = bool((diff <= ulp * torch.maximum(a.float().abs(), b.float().abs())).all())
        return {**row, "agree": within, "equal": False,
                "detail": f"max |diff| {diff.max().item():.3g} ({'within' if within else 'beyond'} rounding)"}
    differ = (bits(a) != bits(b)).reshape(a.shape[0], -1).any(-1) if a.dim() else torch.tensor([True])
    first = int(differ.nonzero()[0, 0]) if differ.any() else -1
    return {**row, "agree": False, "equal": False, "detail": f"{int(differ.sum())} rows differ, first {first}"}


def compare(impl_a, impl_b, group, device, hidden: int = 7168, num_tokens: int = 1024, num_experts: int = 64,
            num_topk: int = 8, seed: int = 0) -> list[dict]:
    """Every rank's comparison rows (all ranks', on every rank)."""
    rank = group.rank()
    inputs = make_inputs(rank, device, hidden, num_tokens, num_experts, num_topk, seed)
    a, b = run(impl_a, group, inputs, num_experts), run(impl_b, group, inputs, num_experts)
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    rows = [{"rank": rank, **compare_outputs(name, a[name], b[name], group.size())} for name in a]
    gathered = [None] * group.size()
    dist.all_gather_object(gathered, rows, group=group)
    return [row for rank_rows in gathered for row in rank_rows]


def table(rows: list[dict]) -> str:
    lines = [f"{'rank':>4}  {'output':<46} {'dtype':<14} {'shape':<14} {'agree':<6} detail"]
    for r in rows:
        lines.append(f"{r['rank']:>4}  {r['output']:<46} {r['dtype']:<14} {str(r['shape']):<14} "
                     f"{'yes' if r['agree'] else 'NO':<6} {r['detail']}")
    return "\n".join(lines)


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "moepass", "tests/doubles",
                                "examples/compare_deepep_double.py"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        return head + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(impl) -> str:
    return getattr(impl, "__version__", None) or _distribution_version("deep_ep")


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return "unknown"


def write_json(rows: list[dict], out_dir: str, command: str, implementations: tuple[str, str],
               versions: tuple[str, str] | None = None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    gpu = (f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu")
    record = {"schema": "moepass.compare_deepep_double/1", "date": datetime.date.today().isoformat(), "gpu": gpu,
              "torch": torch.__version__, "implementations": list(implementations),
              "versions": list(versions or ("", "")), "commit": _commit(), "command": command,
              "all_agree": all(r["agree"] for r in rows), "all_equal": all(r["equal"] for r in rows), "rows": rows}
    path = os.path.join(out_dir, "compare.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/compare_deepep_double")
    parser.add_argument("--impl-a", default="deep_ep", choices=("deep_ep", "double"))
    parser.add_argument("--impl-b", default="double", choices=("deep_ep", "double"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    impls = (load_implementation(args.impl_a), load_implementation(args.impl_b))
    rows = compare(*impls, dist.group.WORLD, torch.device(args.device, local_rank) if args.device == "cuda" else
                   torch.device("cpu"), args.hidden, args.tokens, args.experts, args.topk, args.seed)
    if dist.get_rank() == 0:
        print(table(rows))
        command = "torchrun --nproc-per-node {} examples/compare_deepep_double.py {}".format(
            dist.get_world_size(), " ".join(argv if argv is not None else sys.argv[1:]))
        path = write_json(rows, args.out, command, (args.impl_a, args.impl_b), tuple(_version(i) for i in impls))
        agree = all(r["agree"] for r in rows)
        print(f"{'all outputs agree' if agree else 'OUTPUTS DIFFER'}; {path}")
    ok = all(r["agree"] for r in rows)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
