"""Candidate: each expert weight quantized once into both FP8-rowwise layouts, against what runs today.

    python examples/bench_expert_weight_quant.py --out examples/results/expert_weight_quant_h200.json

Today the compiled FP8 grouped GEMM quantizes each expert weight w [E, N, K] twice per step, in two graphs:
the forward along K (one scale per (expert, output channel)) and the dgrad along N (one scale per (expert,
input channel)), the second a reduction over the strided axis with a transposed write. The candidate here is
two Triton kernels: one read of w for both amaxes (the row amax in registers, the column amax by float atomics),
then one read of w writing both e4m3 layouts (the dgrad one through a transposed tile). It moves 6 B per
element against at least 6 B (usually more) for the two Inductor kernels.

For the DeepSeek-V3 16B and 671B expert weights it checks the candidate bit for bit against moepass's
quantization (fp8_rowwise_decomp.cols / rows, as the decompositions call them) and times, with CUDA events,
the two compiled quantizations alone and together and the candidate. It is an experiment: the candidate is
not wired into the grouped GEMM ops (that needs the forward to save the dgrad layout for the backward); the
JSON says whether it would pay.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from bench_fp8_gemms import compiled, provenance, time_ms
from moepass.ops import fp8_rowwise_decomp as decomp
from moepass.ops.formats import E4M3, E4M3_MAX
from moepass.ops.fp8_rowwise_quant import AMAX_EPS, scale_from_amax

import triton
import triton.language as tl

# (model, weight, experts, N, K): w [E, N, K] as the model stores it; the GEMM sees w_t = w.transpose(-2, -1)
WEIGHTS = [("16B", "w1|w3", 64, 1408, 2048), ("16B", "w2", 64, 2048, 1408),
           ("671B", "w1|w3", 64, 2048, 7168), ("671B", "w2", 64, 7168, 2048)]
# 128 x 64 was the fastest of six tiles on an H200 (examples/results/expert_weight_quant_h200.json)
BLOCK_N, BLOCK_K = 128, 64


@triton.jit
def _pow2_scale(amax, FP8_MAX: tl.constexpr, EPS: tl.constexpr):
    scale = FP8_MAX / tl.maximum(amax, EPS)
    return (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _amax_both_kernel(w_ptr, row_amax_ptr, col_amax_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, e = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    base = w_ptr + e.to(tl.int64) * N * K
    row_amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.abs(tl.load(base + n[:, None] * K + k[None, :], mask=(n < N)[:, None] & (k < K)[None, :],
                           other=0.0).to(tl.float32))
        row_amax = tl.maximum(row_amax, tl.max(x, axis=1))
        tl.atomic_max(col_amax_ptr + e * K + k, tl.max(x, axis=0), mask=k < K)
    tl.store(row_amax_ptr + e * N + n, row_amax, mask=n < N)


@triton.jit
def _quantize_both_kernel(w_ptr, row_amax_ptr, col_amax_ptr, q_fwd_ptr, q_dgrad_ptr, N, K,
                          FP8_MAX: tl.constexpr, EPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (n < N)[:, None] & (k < K)[None, :]
    offset = e.to(tl.int64) * N * K
    x = tl.load(w_ptr + offset + n[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
    row_scale = _pow2_scale(tl.load(row_amax_ptr + e * N + n, mask=n < N, other=1.0), FP8_MAX, EPS)
    col_scale = _pow2_scale(tl.load(col_amax_ptr + e * K + k, mask=k < K, other=1.0), FP8_MAX, EPS)
    q_fwd = tl.clamp(x * row_scale[:, None], -FP8_MAX, FP8_MAX).to(q_fwd_ptr.dtype.element_ty)
    tl.store(q_fwd_ptr + offset + n[:, None] * K + k[None, :], q_fwd, mask=mask)
    q_dgrad = tl.clamp(x * col_scale[None, :], -FP8_MAX, FP8_MAX).to(q_dgrad_ptr.dtype.element_ty)
    tl.store(q_dgrad_ptr + offset + k[:, None] * N + n[None, :], tl.trans(q_dgrad), mask=tl.trans(mask))


def both_layouts(w: torch.Tensor, block_n: int = BLOCK_N, block_k: int = BLOCK_K):
    """w [E, N, K] bf16 -> (q_fwd [E, N, K], scale [E, N]) along K and (q_dgrad [E, K, N], scale [E, K]) along N."""
    E, N, K = w.shape
    row_amax = torch.empty(E, N, device=w.device, dtype=torch.float32)
    col_amax = torch.zeros(E, K, device=w.device, dtype=torch.float32)
    q_fwd = torch.empty(E, N, K, device=w.device, dtype=E4M3)
    q_dgrad = torch.empty(E, K, N, device=w.device, dtype=E4M3)
    _amax_both_kernel[(triton.cdiv(N, block_n), E)](w, row_amax, col_amax, N, K, BLOCK_N=block_n, BLOCK_K=block_k)
    _quantize_both_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k), E)](
        w, row_amax, col_amax, q_fwd, q_dgrad, N, K, FP8_MAX=E4M3_MAX, EPS=AMAX_EPS,
        BLOCK_N=block_n, BLOCK_K=block_k)
    scale_of = scale_from_amax  # the reference rounding, for the scales the GEMMs get
    return (q_fwd, scale_of(row_amax)), (q_dgrad, scale_of(col_amax))


def fwd_layout(w):
    return decomp.cols(w.transpose(-2, -1))


def dgrad_layout(w):
    return decomp.rows(w.transpose(-2, -1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="examples/results/expert_weight_quant_h200.json")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--blocks", default="", help="also time these tiles, e.g. 32x256,128x64 (BLOCK_N x BLOCK_K)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_expert_weight_quant: needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {"schema": "moepass.bench_expert_weight_quant/1", **provenance(torch.cuda.get_device_capability()),
              "blocks": {"n": BLOCK_N, "k": BLOCK_K}, "rows": []}
    run = lambda fn: time_ms(fn, args.warmup, args.iters)  # noqa: E731
    fwd_c, dgrad_c = compiled(fwd_layout, False), compiled(dgrad_layout, False)
    both_c = compiled(lambda w: (fwd_layout(w), dgrad_layout(w)), False)
    for model, name, experts, n, k in WEIGHTS:
        torch._dynamo.reset()
        w = (torch.randn(experts, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        (qf, sf), (qd, sd) = both_layouts(w)
        (rf, rsf), (rd, rsd) = fwd_layout(w), dgrad_layout(w)
        exact = {"fwd_data": torch.equal(qf.view(torch.uint8), rf.transpose(-2, -1).contiguous().view(torch.uint8)),
                 "fwd_scale": torch.equal(sf, rsf.squeeze(1)),
                 "dgrad_data": torch.equal(qd.view(torch.uint8), rd.contiguous().view(torch.uint8)),
                 "dgrad_scale": torch.equal(sd, rsd.squeeze(-1))}
        row = {"model": model, "weight": name, "shape_E_N_K": [experts, n, k], "bit_exact": exact,
               "compiled_fwd_layout_ms": round(run(lambda: fwd_c(w)), 4),
               "compiled_dgrad_layout_ms": round(run(lambda: dgrad_c(w)), 4),
               "compiled_both_one_graph_ms": round(run(lambda: both_c(w)), 4),
               "candidate_ms": round(run(lambda: both_layouts(w)), 4)}
        today = row["compiled_fwd_layout_ms"] + row["compiled_dgrad_layout_ms"]
        row["today_ms"] = round(today, 4)
        row["saved_ms"] = round(today - row["candidate_ms"], 4)
        row["candidate_GBps_at_6B_per_element"] = round(6 * w.numel() / row["candidate_ms"] / 1e6, 1)
        row["candidate_ms_by_tile"] = {
            tile: round(run(lambda bn=int(tile.split("x")[0]), bk=int(tile.split("x")[1]): both_layouts(w, bn, bk)), 4)
            for tile in filter(None, args.blocks.split(","))}
        result["rows"].append(row)
        print(f"{model:<5} {name:<6} E={experts} N={n} K={k}: today {today:.3f} ms (fwd {row['compiled_fwd_layout_ms']:.3f}"
              f" + dgrad {row['compiled_dgrad_layout_ms']:.3f}), one graph {row['compiled_both_one_graph_ms']:.3f}, "
              f"candidate {row['candidate_ms']:.3f} ms {row['candidate_ms_by_tile']}, exact {all(exact.values())}",
              flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
