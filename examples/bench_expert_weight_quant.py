"""Each expert weight quantized once into both FP8-rowwise layouts, against the two quantizations of today.

    python examples/bench_expert_weight_quant.py --out examples/results/expert_weight_quant_h200.json

Today the compiled FP8 grouped GEMM quantizes each expert weight w [E, N, K] twice per step, in two graphs:
the forward along K (one scale per (expert, output channel)) and the dgrad along N (one scale per (expert,
input channel)), the second a reduction over the strided axis with a transposed write. Under the option
fp8_rowwise.expert_weights_once, moepass::fp8_rowwise_expert_weights does both with two Triton kernels
(moepass/ops/lowp/fp8_rowwise/kernels/triton_both_layouts.py): one read of w for both amaxes (per tile, reduced by
torch), then one read writing both e4m3 layouts (the dgrad one through a transposed tile).

For the DeepSeek-V3 16B and 671B expert weights it checks the op bit for bit against moepass's quantization
(fp8_rowwise.decomp.cols / rows, as the default decompositions call them) and times, with CUDA events, the two
compiled quantizations alone and in one graph, and the op (at its default tile and at each of --blocks).
The training step with the option: `moepass bench ... --variant 'once={"fp8_rowwise.expert_weights_once": true}'`.

--linear times the same two kernels on linear operands [M, C] (the gradients and inputs of DeepSeek-V3's big
linears at the benchmarks' token counts), as moepass::fp8_rowwise_rows_and_cols runs them under the option
fp8_rowwise.linear_both_layouts, against the compiled per-row and per-column quantizations of today.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

import moepass.ops  # noqa: F401  (registers torch.ops.moepass.fp8_rowwise_expert_weights, _rows_and_cols)
from bench_fp8_gemms import compiled, provenance, time_ms
from moepass.ops.lowp.fp8_rowwise import decomp
from moepass.ops.lowp.fp8_rowwise.kernels.triton_both_layouts import both_layouts

# (model, weight, experts, N, K): w [E, N, K] as the model stores it; the GEMM sees w_t = w.transpose(-2, -1)
WEIGHTS = [("16B", "w1|w3", 64, 1408, 2048), ("16B", "w2", 64, 2048, 1408),
           ("671B", "w1|w3", 64, 2048, 7168), ("671B", "w2", 64, 7168, 2048)]


# (model, operand, M, C): tokens x channels at the step benchmarks' token counts (16B 8x4096, 671B dims 4x4096)
LINEAR_OPERANDS = [("16B", "dense FFN w1|w3 grad", 32768, 10944), ("16B", "wq grad", 32768, 3072),
                   ("16B", "dense FFN w2 input", 32768, 10944), ("671B", "wq_b grad", 16384, 24576),
                   ("671B", "dense FFN w1|w3 grad", 16384, 18432), ("671B", "wo input", 16384, 16384),
                   ("671B", "shared expert grad", 16384, 2048)]


def fwd_layout(w):
    return decomp.cols(w.transpose(-2, -1))


def dgrad_layout(w):
    return decomp.rows(w.transpose(-2, -1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="examples/results/expert_weight_quant_h200.json")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--blocks", default="", help="also time the op with these quantize-pass tiles, e.g. 32x256,128x64 "
                   "(rows x columns; the amax pass keeps its own)")
    p.add_argument("--linear", action="store_true", help="also time linear operands (LINEAR_OPERANDS)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_expert_weight_quant: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"schema": "moepass.bench_expert_weight_quant/3", **provenance(torch.cuda.get_device_capability()),
              "rows": []}
    run = lambda fn: time_ms(fn, args.warmup, args.iters)  # noqa: E731
    fwd_c, dgrad_c = compiled(fwd_layout, False), compiled(dgrad_layout, False)
    both_c = compiled(lambda w: (fwd_layout(w), dgrad_layout(w)), False)
    for model, name, experts, n, k in WEIGHTS:
        torch._dynamo.reset()
        w = (torch.randn(experts, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        w_t = w.transpose(-2, -1)
        got = torch.ops.moepass.fp8_rowwise_expert_weights(w_t)
        exact = {part: torch.equal(a.float(), b.float()) for part, a, b in zip(
            ("fwd_data", "fwd_scale", "dgrad_data", "dgrad_scale"), got, (*fwd_layout(w), *dgrad_layout(w)))}
        row = {"model": model, "weight": name, "shape_E_N_K": [experts, n, k], "bit_exact": exact,
               "compiled_fwd_layout_ms": round(run(lambda: fwd_c(w)), 4),
               "compiled_dgrad_layout_ms": round(run(lambda: dgrad_c(w)), 4),
               "compiled_both_one_graph_ms": round(run(lambda: both_c(w)), 4),
               "candidate_ms": round(run(lambda: torch.ops.moepass.fp8_rowwise_expert_weights(w_t)), 4)}
        today = row["compiled_fwd_layout_ms"] + row["compiled_dgrad_layout_ms"]
        row["today_ms"] = round(today, 4)
        row["saved_ms"] = round(today - row["candidate_ms"], 4)
        row["candidate_GBps_at_6B_per_element"] = round(6 * w.numel() / row["candidate_ms"] / 1e6, 1)
        row["candidate_ms_by_tile"] = {
            tile: round(run(lambda br=int(tile.split("x")[0]), bc=int(tile.split("x")[1]): both_layouts(w, br, bc)), 4)
            for tile in filter(None, args.blocks.split(","))}
        result["rows"].append(row)
        print(f"{model:<5} {name:<6} E={experts} N={n} K={k}: today {today:.3f} ms (fwd {row['compiled_fwd_layout_ms']:.3f}"
              f" + dgrad {row['compiled_dgrad_layout_ms']:.3f}), one graph {row['compiled_both_one_graph_ms']:.3f}, "
              f"op {row['candidate_ms']:.3f} ms {row['candidate_ms_by_tile']}, exact {all(exact.values())}", flush=True)
    if args.linear:
        result["linear_rows"] = [linear_row(*spec, run) for spec in LINEAR_OPERANDS]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def linear_row(model: str, operand: str, m: int, c: int, run) -> dict:
    """One linear operand: the op against today's compiled per-row and per-column quantizations."""
    torch._dynamo.reset()
    t = torch.randn(m, c, device="cuda").to(torch.bfloat16)
    rows_c, cols_c = compiled(decomp.rows, False), compiled(decomp.cols, False)
    got = torch.ops.moepass.fp8_rowwise_rows_and_cols(t)
    exact = all(torch.equal(a.float(), b.float()) for a, b in zip(got, (*decomp.rows(t), *decomp.cols(t))))
    row = {"model": model, "operand": operand, "shape_M_C": [m, c], "bit_exact": exact,
           "compiled_rows_ms": round(run(lambda: rows_c(t)), 4), "compiled_cols_ms": round(run(lambda: cols_c(t)), 4),
           "candidate_ms": round(run(lambda: torch.ops.moepass.fp8_rowwise_rows_and_cols(t)), 4)}
    row["today_ms"] = round(row["compiled_rows_ms"] + row["compiled_cols_ms"], 4)
    row["candidate_GBps_at_6B_per_element"] = round(6 * t.numel() / row["candidate_ms"] / 1e6, 1)
    print(f"{model:<5} {operand:<22} M={m} C={c}: today {row['today_ms']:.3f} ms (rows {row['compiled_rows_ms']:.3f}"
          f" + cols {row['compiled_cols_ms']:.3f}), op {row['candidate_ms']:.3f} ms "
          f"({row['candidate_GBps_at_6B_per_element']} GB/s), exact {exact}", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
