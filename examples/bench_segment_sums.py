"""Speed of an MoE's scatter-adds of rows on one GPU: Inductor's atomic adds against moepass::segment_sum_rows.

    python examples/bench_segment_sums.py --out examples/results/segment_sums_h100.json

At DeepSeek-V3 dims (16,384 tokens, 8 experts a token) times, side by side in one run, the two sums a MoE layer
makes each step, each compiled by Inductor as the model writes it and as moepass::segment_sum_rows
(inductor_stage/segment_sums.py):
- the combine: the experts' BF16 output rows added into their tokens in fp32
  (`zeros(f32).index_add(0, token_of_slot, y.float())`, models/moe.py), rounded to BF16;
- the backward of the gather x[token_of_slot]: the dgrads of w1 and w3 added, then into their tokens in BF16.
Reports ms (CUDA events, median), the GB/s of the bytes each must move (the rows read once, the tokens written
once), the speedup, and the largest difference from an fp64 sum relative to its largest value, for both.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_fp8_gemms import provenance, save_json, time_ms
from moepass.ops.rows.segment_sum import segment_sum_rows

# (model, tokens T, top_k, D)
SHAPES = [("671B", 16384, 8, 7168), ("16B", 32768, 6, 2048)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="segment_sums.json")
    return p.parse_args(argv)


def _combine(y, idx, n):
    return torch.zeros(n, y.shape[1], dtype=torch.float32, device=y.device).index_add(0, idx, y.float()).bfloat16()


def _gather_grad(a, b, idx, n):
    return torch.zeros(n, a.shape[1], dtype=a.dtype, device=a.device).index_put((idx,), a + b, accumulate=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_segment_sums: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {**provenance(torch.cuda.get_device_capability()), "rows": []}
    print(f"{result['gpu']}, torch {result['torch']}; ms (GB/s), speedup, max error relative to the fp64 sum's max")
    combine, gather_grad = (torch.compile(f, backend="inductor", fullgraph=True) for f in (_combine, _gather_grad))
    for model, tokens, top_k, d in SHAPES:
        m = tokens * top_k
        gen = torch.Generator(device="cuda").manual_seed(0)
        idx = torch.argsort(torch.randint(0, 64, (m,), device="cuda", generator=gen), stable=True) // top_k
        a, b = (torch.randn(m, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        cases = {"combine": (lambda: combine(a, idx, tokens), lambda: segment_sum_rows([a], idx, tokens, torch.bfloat16),
                             [a], 2 * m * d + 2 * tokens * d),
                 "gather backward": (lambda: gather_grad(a, b, idx, tokens),
                                     lambda: segment_sum_rows([a, b], idx, tokens, torch.bfloat16),
                                     [a, b], 4 * m * d + 2 * tokens * d)}
        for name, (inductor, segments, srcs, nbytes) in cases.items():
            exact = torch.zeros(tokens, d, dtype=torch.float64, device="cuda").index_add_(
                0, idx, sum(s.double() for s in srcs))
            row = {"model": model, "sum": name, "tokens": tokens, "top_k": top_k, "D": d, "ms": {}, "gb_s": {},
                   "max_rel_error": {}}
            for label, fn in (("inductor", inductor), ("segment_sum_rows", segments)):
                err = (fn().double() - exact).abs().max() / exact.abs().max()
                ms = time_ms(fn, args.warmup, args.iters)
                row["ms"][label], row["gb_s"][label] = round(ms, 4), round(nbytes / ms / 1e6, 1)
                row["max_rel_error"][label] = float(f"{err.item():.3g}")
            row["speedup"] = round(row["ms"]["inductor"] / row["ms"]["segment_sum_rows"], 3)
            result["rows"].append(row)
            print(f"{model:<5} {name:<16} inductor {row['ms']['inductor']:.3f} ({row['gb_s']['inductor']:.0f})  "
                  f"segment_sum_rows {row['ms']['segment_sum_rows']:.3f} ({row['gb_s']['segment_sum_rows']:.0f})  "
                  f"{row['speedup']:.2f}x  error {row['max_rel_error']}", flush=True)
            del exact
        del a, b
    save_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
