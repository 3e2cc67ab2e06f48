"""Speed of the grouped wgrad's token-group quantization (moepass/ops/lowp/fp8_rowwise/kernels/
triton_token_group_cols.py) on one GPU.

    python examples/bench_token_group_quant.py --out examples/results/token_group_quant_h200.json

For the routed-token operands of the DeepSeek-V3 16B and 671B expert wgrads ([M, D] bf16 -> e4m3 [D, P] in
16-aligned token groups, one scale per (group, column)), times token_group_cols_padded at each tile shape
in --tiles and its default (CUDA events, median), checks every result bit for bit against the plain-torch reference, and
reports ms and GB/s of the bytes it must move (read the bf16 once, write the e4m3 once: 3 B per element;
the kernels read twice, so 60% of the bandwidth is their ceiling). --compare module:function times
another implementation with the same signature side by side (e.g. a candidate kernel).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import shlex
import sys

import torch

from bench_fp8_gemms import routed_group_sizes, save_json, time_ms
from moepass.harness.provenance import git_commit, package_version
from moepass.ops.lowp.fp8_rowwise import quant
from moepass.ops.lowp.fp8_rowwise.kernels import triton_token_group_cols as triton_ops

# (model, operand, experts, routed rows M, columns D): the wgrad operands of bench_fp8_gemms.GROUPED
SHAPES = [("16B", "x of w1|w3, grad of w2", 64, 196608, 2048), ("16B", "grad of w1|w3, x of w2", 64, 196608, 1408),
          ("671B", "x of w1|w3, grad of w2", 32, 65536, 7168), ("671B", "grad of w1|w3, x of w2", 32, 65536, 2048),
          ("16B skewed", "x of w1|w3, grad of w2", 64, 196608, 2048)]


def group_sizes(model: str, experts: int, rows: int, seed: int) -> list[int]:
    """Routed token groups; "skewed": a collapsed router (a few experts take most tokens), as early in training."""
    if "skewed" not in model:
        return routed_group_sizes(experts, rows, seed)
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen) * 2.0, 0)
    return torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen), minlength=experts).tolist()
TILES = "64x64x4,128x64x4,64x128x4,32x64x4,128x128x8,64x32x4"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", default=TILES, help="rows x columns x warps per program, comma list")
    p.add_argument("--compare", action="append", default=[], help="module:function to time alongside")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="token_group_quant.json")
    return p.parse_args(argv)


def check_exact(result, ref_q: torch.Tensor, ref_scale: torch.Tensor, sizes: list[int]) -> None:
    """The padded layout holds the reference's e4m3 bits group by group, and zeros in the padding."""
    q_t, scale, padded_ends = result
    if not torch.equal(scale, ref_scale):
        raise AssertionError("scales differ from fp8_rowwise.quant.token_group_cols")
    start, p_start = 0, 0
    for size, p_end in zip(sizes, padded_ends.tolist()):
        block = q_t[:, p_start:p_end].view(torch.uint8)
        if not torch.equal(block[:, :size], ref_q[start:start + size].t().view(torch.uint8)) or block[:, size:].any():
            raise AssertionError(f"e4m3 data differs in the group at padded rows {p_start}:{p_end}")
        start, p_start = start + size, p_end


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_token_group_quant: needs a CUDA GPU", file=sys.stderr)
        return 2
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    impls = {"default": triton_ops.token_group_cols_padded}
    impls |= {f"tiles {m}x{d}x{w}": (lambda t, o, m=m, d=d, w=w: triton_ops.token_group_cols_padded(
        t, o, block_m=m, block_d=d, num_warps=w)) for m, d, w in tiles}
    for spec in args.compare:
        module, fn = spec.split(":")
        impls[spec] = getattr(importlib.import_module(module), fn)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": package_version("triton"),
              "commit": git_commit()["commit"], "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "default_tiles": f"{triton_ops.BLOCK_M}x({triton_ops.BLOCK_D} or half with few programs)x4", "rows": []}
    print(f"{result['gpu']}, torch {result['torch']}; ms (GB/s of 3 B per element moved)")
    for model, operand, experts, m, d in SHAPES:
        sizes = group_sizes(model, experts, m, seed=d)
        offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
        t = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
        ref_q, ref_scale = quant.token_group_cols(t, offs)
        row = {"model": model, "operand": operand, "experts": experts, "M": m, "D": d,
               "group_sizes_min_max": [min(sizes), max(sizes)], "ms": {}, "gb_s": {}}
        for name, fn in impls.items():
            check_exact(fn(t, offs), ref_q, ref_scale, sizes)
            ms = time_ms(lambda: fn(t, offs), args.warmup, args.iters)
            row["ms"][name], row["gb_s"][name] = round(ms, 4), round(3 * m * d / ms / 1e6, 1)
        row["fastest"] = min(row["ms"], key=row["ms"].get)
        result["rows"].append(row)
        print(f"{model:<10} M={m} D={d:<5} max group {max(sizes):<6} " + "  ".join(f"{k}: {row['ms'][k]:.3f} ({row['gb_s'][k]:.0f})"
                                                     for k in impls), flush=True)
        del t, ref_q
    save_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
