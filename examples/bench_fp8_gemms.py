"""Per-GEMM speed of the FP8-rowwise recipe against BF16 on one Hopper GPU, forward and backward.

    python examples/bench_fp8_gemms.py --out examples/results/fp8_gemms_h200.json

For each DeepSeek-V3 16B and 671B linear and routed-expert GEMM (and a size sweep for the recipe's
thresholds) it times, side by side in one run, with CUDA events (median of --iters after warm-up):
  bf16         F.linear's three GEMMs (torch.mm) / torch._grouped_mm's three
  fp8_rowwise  the moepass::fp8_rowwise_* ops, kernel "scaled_mm": Triton quantization + torch._scaled_mm /
               torch._scaled_grouped_mm, everything the training step pays
  fp8_gemm     the FP8 GEMMs alone on pre-quantized operands (so quantization = fp8_rowwise - fp8_gemm);
               for linears also without fast accumulation
  blockwise    DeepSeek-V3's recipe (1x128 activations, 128x128 weights) from torchao, where it runs
and reports TFLOP/s, speedups, the ops' SQNR against fp32, the recipe moepass picks for each GEMM,
and a suggested FP8_ROWWISE_MIN for moepass/fp8_recipe.py. The whole-training-step comparison is
`moepass bench` (the command to run is printed at the end).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import shlex
import statistics
import sys
import time

import torch

import moepass.ops.fp8_rowwise_grouped_mm  # noqa: F401  (registers torch.ops.moepass.fp8_rowwise_*)
import moepass.ops.fp8_rowwise_linear  # noqa: F401
from moepass.bench import git_commit, package_version
from moepass import fp8_recipe
from moepass.ops import fp8_rowwise_quant as quant
from moepass.ops.fp8_rowwise_grouped_mm import FAST_ACCUM as GROUPED_FAST_ACCUM
from moepass.ops.fp8_rowwise_linear import FAST_ACCUM as LINEAR_FAST_ACCUM

ops = torch.ops.moepass
BF16 = torch.bfloat16
SCHEMA = "moepass.bench_fp8_gemms/1"
GEMMS = ("fwd", "dgrad", "wgrad")
DEVICE = "cuda"

# (model, GEMM, K, N): y[M, N] = x[M, K] @ W[N, K].T, from models/config.py's 16B and 671B flavors.
LINEARS = [
    ("16B", "attention.wq", 2048, 3072), ("16B", "attention.wkv_a", 2048, 576),
    ("16B", "attention.wkv_b", 512, 4096), ("16B", "attention.wo", 2048, 2048),
    ("16B", "dense_ffn.w1|w3", 2048, 10944), ("16B", "dense_ffn.w2", 10944, 2048),
    ("16B", "shared_experts.w1|w3", 2048, 2816), ("16B", "shared_experts.w2", 2816, 2048),
    ("671B", "attention.wq_a", 7168, 1536), ("671B", "attention.wq_b", 1536, 24576),
    ("671B", "attention.wkv_a", 7168, 576), ("671B", "attention.wkv_b", 512, 32768),
    ("671B", "attention.wo", 16384, 7168), ("671B", "dense_ffn.w1|w3", 7168, 18432),
    ("671B", "dense_ffn.w2", 18432, 7168), ("671B", "shared_experts.w1|w3", 7168, 2048),
    ("671B", "shared_experts.w2", 2048, 7168),
]
# (model, GEMM, experts on this GPU, routed rows M, K, N): 16B has 64 experts (top-6) on one GPU;
# 671B's 256 experts (top-8) are shown as one expert-parallel rank's 16 or 32.
GROUPED = [
    ("16B", "experts.w1|w3", 64, 16384, 2048, 1408), ("16B", "experts.w2", 64, 16384, 1408, 2048),
    ("16B", "experts.w1|w3", 64, 65536, 2048, 1408), ("16B", "experts.w2", 64, 65536, 1408, 2048),
    ("16B", "experts.w1|w3", 16, 16384, 2048, 1408), ("16B", "experts.w2", 16, 16384, 1408, 2048),
    ("671B", "experts.w1|w3", 16, 16384, 7168, 2048), ("671B", "experts.w2", 16, 16384, 2048, 7168),
    ("671B", "experts.w1|w3", 32, 16384, 7168, 2048), ("671B", "experts.w2", 32, 16384, 2048, 7168),
]
SWEEP_DIMS, SWEEP_TOKENS = (512, 1024, 2048, 4096), (1024, 4096, 16384)
GROUPED_SWEEP = [(16, tokens_per_expert * 16, d, d) for d in (1024, 2048) for tokens_per_expert in (128, 512, 2048)]


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median CUDA-event time of fn() over `iters` runs, back to back as in a training step."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def sqnr_db(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref = ref.double()
    return round(float(20 * torch.log10(ref.norm() / (ref - out.double()).norm())), 2)


def tflops(flop: float, ms: float) -> float:
    return round(flop / ms / 1e9, 1)


def summarize(bf16: dict, fp8: dict, flop: float) -> dict:
    total_bf16, total_fp8 = sum(bf16[g] for g in GEMMS), sum(fp8[g] for g in GEMMS)
    return {
        "bf16_ms": {g: round(bf16[g], 4) for g in GEMMS},
        "fp8_rowwise_ms": {g: round(fp8[g], 4) for g in GEMMS},
        "bf16_tflops": {g: tflops(flop, bf16[g]) for g in GEMMS},
        "fp8_rowwise_tflops": {g: tflops(flop, fp8[g]) for g in GEMMS},
        "speedup": {**{g: round(bf16[g] / fp8[g], 3) for g in GEMMS}, "fwd+bwd": round(total_bf16 / total_fp8, 3)},
        "saved_ms": round(total_bf16 - total_fp8, 4),
    }


# ---- linears ------------------------------------------------------------------------------------

def bench_linear(m: int, k: int, n: int, args, extras: bool) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(m + k + n)
    x = torch.randn(m, k, device=DEVICE, dtype=BF16, generator=gen)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(BF16)
    g = torch.randn(m, n, device=DEVICE, dtype=BF16, generator=gen)
    run = lambda fn: time_ms(fn, args.warmup, args.iters)  # noqa: E731
    bf16 = {"fwd": run(lambda: torch.mm(x, w.t())), "dgrad": run(lambda: torch.mm(g, w)),
            "wgrad": run(lambda: torch.mm(g.t(), x))}
    fp8 = {"fwd": run(lambda: ops.fp8_rowwise_linear(x, w, None, False, "scaled_mm")),
           "dgrad": run(lambda: ops.fp8_rowwise_linear_dgrad(g, w, "scaled_mm")),
           "wgrad": run(lambda: ops.fp8_rowwise_linear_wgrad(g, x, "scaled_mm"))}
    row = {"M": m, "K": k, "N": n, **summarize(bf16, fp8, 2.0 * m * k * n)}
    recipe, reason = fp8_recipe.choose_recipe(DEVICE, "linear", m, k, n)
    row["auto_recipe"], row["auto_reason"] = recipe, reason
    if not extras:
        return row
    # The FP8 GEMMs alone, with and without fast accumulation: what quantization and promotion cost.
    x_q, x_s = quant.rows(x, "scaled_mm")
    w_q, w_s = quant.rows(w, "scaled_mm")
    g_q, g_s = quant.rows(g, "scaled_mm")
    wc_q, wc_s = quant.cols(w, "scaled_mm")
    gc_q, gc_s = quant.cols(g, "scaled_mm")
    xc_q, xc_s = quant.cols(x, "scaled_mm")
    operands = {"fwd": (x_q, x_s, w_q.t(), w_s.reshape(1, -1)), "dgrad": (g_q, g_s, wc_q, wc_s),
                "wgrad": (gc_q.t(), gc_s.reshape(-1, 1), xc_q, xc_s)}
    gemm = {}
    for fast in (True, False):
        for name, (a, sa, b, sb) in operands.items():
            ia, ib = sa.reciprocal(), sb.reciprocal()
            gemm[f"{name}{'' if fast else '_no_fast_accum'}"] = round(run(
                lambda a=a, b=b, ia=ia, ib=ib, fast=fast: torch._scaled_mm(
                    a, b, scale_a=ia, scale_b=ib, out_dtype=BF16, use_fast_accum=fast)), 4)
    row["fp8_gemm_ms"] = gemm
    row["quantization_ms"] = {name: round(fp8[name] - gemm[name if LINEAR_FAST_ACCUM[name] else
                                                            f"{name}_no_fast_accum"], 4) for name in GEMMS}
    ref = (x.float() @ w.float().t(), g.float() @ w.float(), g.float().t() @ x.float())
    got = (ops.fp8_rowwise_linear(x, w, None, False, "scaled_mm"), ops.fp8_rowwise_linear_dgrad(g, w, "scaled_mm"),
           ops.fp8_rowwise_linear_wgrad(g, x, "scaled_mm"))
    row["sqnr_db"] = {name: sqnr_db(r, o) for name, r, o in zip(GEMMS, ref, got)}
    row["blockwise"] = bench_blockwise_linear(x, w, g, run)
    return row


def bench_blockwise_linear(x, w, g, run) -> dict:
    """torchao's DeepSeek-V3 blockwise linear (1x128 activations, 128x128 weights), forward and backward."""
    if x.shape[1] % 128 or w.shape[0] % 128:
        return {"skipped": "K and N must be multiples of 128 for 128x128 weight blocks"}
    try:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        xl = x.detach().requires_grad_()
        wl = w.detach().requires_grad_()
        fwd = run(lambda: fp8_blockwise_mm.apply(x, w, 128))
        both = run(lambda: fp8_blockwise_mm.apply(xl, wl, 128).backward(g))
        return {"fwd_ms": round(fwd, 4), "dgrad+wgrad_ms": round(both - fwd, 4)}
    except Exception as e:  # noqa: BLE001 - a missing kernel is a result, not a crash
        return {"error": f"{type(e).__name__}: {e}"[:300]}


# ---- grouped expert GEMMs -------------------------------------------------------------------------

def routed_group_sizes(experts: int, rows: int, seed: int) -> list[int]:
    """Uneven token groups as a softmax router gives them (multinomial draws, sizes not multiples of 16)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen) * 0.5, 0)
    return torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen), minlength=experts).tolist()


def bench_grouped(experts: int, m: int, k: int, n: int, args, extras: bool) -> dict:
    sizes = routed_group_sizes(experts, m, seed=experts + m + k)
    gen = torch.Generator(device=DEVICE).manual_seed(m + k + n)
    x = torch.randn(m, k, device=DEVICE, dtype=BF16, generator=gen)
    w_t = (torch.randn(experts, n, k, device=DEVICE, generator=gen) / k**0.5).to(BF16).transpose(-2, -1)
    g = torch.randn(m, n, device=DEVICE, dtype=BF16, generator=gen)
    offs = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    run = lambda fn: time_ms(fn, args.warmup, args.iters)  # noqa: E731
    bf16 = {"fwd": run(lambda: torch._grouped_mm(x, w_t, offs=offs)),
            "dgrad": run(lambda: torch._grouped_mm(g, w_t.transpose(-2, -1), offs=offs)),
            "wgrad": run(lambda: torch._grouped_mm(x.t(), g, offs=offs))}
    fp8 = {"fwd": run(lambda: ops.fp8_rowwise_grouped_mm(x, w_t, offs, False, "scaled_mm")),
           "dgrad": run(lambda: ops.fp8_rowwise_grouped_mm_dgrad(g, w_t, offs, "scaled_mm")),
           "wgrad": run(lambda: ops.fp8_rowwise_grouped_mm_wgrad(g, x, offs, "scaled_mm"))}
    row = {"experts": experts, "M": m, "K": k, "N": n, "tokens_per_expert": m // experts,
           "group_sizes_min_max": [min(sizes), max(sizes)], **summarize(bf16, fp8, 2.0 * m * k * n)}
    recipe, reason = fp8_recipe.choose_recipe(DEVICE, "grouped", m, k, n, experts=experts)
    row["auto_recipe"], row["auto_reason"] = recipe, reason
    if not extras:
        return row
    from moepass.ops.fp8_rowwise_triton import token_group_cols_padded

    x_q, x_s = quant.rows(x, "scaled_mm")
    g_q, g_s = quant.rows(g, "scaled_mm")
    wk_q, wk_s = quant.experts_along_k(w_t, "scaled_mm")
    wn_q, wn_s = quant.experts_along_n(w_t, "scaled_mm")
    gt_q, gt_s, padded_ends = token_group_cols_padded(g, offs)
    xt_q, xt_s, _ = token_group_cols_padded(x, offs)
    operands = {"fwd": (x_q, x_s.reshape(-1), wk_q, wk_s.squeeze(1), offs),
                "dgrad": (g_q, g_s.reshape(-1), wn_q.transpose(-2, -1), wn_s.squeeze(-1), offs),
                "wgrad": (gt_q, gt_s.reshape(-1), xt_q.t(), xt_s.reshape(-1), padded_ends)}
    gemm = {}
    for name, (a, sa, b, sb, o) in operands.items():
        ia, ib = sa.reciprocal(), sb.reciprocal()
        gemm[name] = round(run(lambda a=a, b=b, ia=ia, ib=ib, o=o: torch._scaled_grouped_mm(
            a, b, ia, ib, o, out_dtype=BF16, use_fast_accum=GROUPED_FAST_ACCUM)), 4)
    row["fp8_gemm_ms"] = gemm
    row["quantization_ms"] = {name: round(fp8[name] - gemm[name], 4) for name in GEMMS}
    ref = [torch.zeros(m, n, device=DEVICE), torch.zeros(m, k, device=DEVICE), torch.zeros(w_t.shape, device=DEVICE)]
    start = 0
    for e, end in enumerate(torch.tensor(sizes).cumsum(0).tolist()):
        xs, gs, we = x[start:end].float(), g[start:end].float(), w_t[e].float()
        ref[0][start:end], ref[1][start:end], ref[2][e] = xs @ we, gs @ we.t(), xs.t() @ gs
        start = end
    got = (ops.fp8_rowwise_grouped_mm(x, w_t, offs, False, "scaled_mm"),
           ops.fp8_rowwise_grouped_mm_dgrad(g, w_t, offs, "scaled_mm"),
           ops.fp8_rowwise_grouped_mm_wgrad(g, x, offs, "scaled_mm"))
    row["sqnr_db"] = {name: sqnr_db(r, o) for name, r, o in zip(GEMMS, ref, got)}
    row["blockwise"] = bench_blockwise_grouped(x, w_t, offs, g, run)
    return row


def bench_blockwise_grouped(x, w_t, offs, g, run) -> dict:
    """torchao's blockwise FP8 grouped GEMM (it needs DeepGEMM on Hopper); recorded as an error where absent."""
    if w_t.shape[1] % 128 or w_t.shape[2] % 128:
        return {"skipped": "K and N must be multiples of 128 for 128x128 weight blocks"}
    try:
        from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm

        w_c = w_t.detach().requires_grad_()
        x_c = x.detach().requires_grad_()
        fwd = run(lambda: _to_fp8_blockwise_then_scaled_grouped_mm(x, w_t, offs=offs))
        both = run(lambda: _to_fp8_blockwise_then_scaled_grouped_mm(x_c, w_c, offs=offs).backward(g))
        return {"fwd_ms": round(fwd, 4), "dgrad+wgrad_ms": round(both - fwd, 4)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}


# ---- the recipe's thresholds from the measurements --------------------------------------------------

def suggest_min_shape(rows: list[dict], tokens_key: str) -> dict:
    """The MinShape that keeps every measured GEMM it sends to FP8 at least as fast as BF16, saving the most."""
    def candidates(key):
        return sorted({r[key] for r in rows})  # thresholds only where measured

    best = None
    for k, n, t in itertools.product(candidates("K"), candidates("N"), candidates(tokens_key)):
        chosen = [r for r in rows if r["K"] >= k and r["N"] >= n and r[tokens_key] >= t]
        if not chosen or any(r["speedup"]["fwd+bwd"] < 1.0 for r in chosen):
            continue
        saved = sum(r["saved_ms"] for r in chosen)
        if best is None or saved > best[0] + 1e-9:
            best = (saved, k, n, t, len(chosen))
    if best is None:
        return {"k": None, "n": None, "tokens": None, "note": "FP8 rowwise was slower than BF16 everywhere measured"}
    saved, k, n, t, count = best
    return {"k": k, "n": n, "tokens": t, "gemms_to_fp8": count, "of": len(rows), "saved_ms": round(saved, 3)}


# ---- provenance and main ------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="examples/results/fp8_gemms_h200.json")
    p.add_argument("--tokens", type=int, default=16384, help="M (tokens) of the DeepSeek-V3 linears")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-sweep", action="store_true", help="skip the size sweep behind the thresholds")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_fp8_gemms: needs a CUDA GPU (sm_89+; grouped GEMMs sm_90)", file=sys.stderr)
        return 2
    began = time.perf_counter()
    cc = torch.cuda.get_device_capability()
    result = {
        "schema": SCHEMA, "gpu": torch.cuda.get_device_name(), "capability": f"sm_{cc[0]}{cc[1]}",
        "torch": torch.__version__, "torchao": package_version("torchao"), "triton": package_version("triton"),
        "cuda": torch.version.cuda, "commit": git_commit()["commit"],
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"tokens": args.tokens, "iters": args.iters, "warmup": args.warmup,
                     "linear_fast_accum": LINEAR_FAST_ACCUM, "grouped_fast_accum": GROUPED_FAST_ACCUM,
                     "thresholds_in_use": {kind: vars(v) for kind, v in fp8_recipe.FP8_ROWWISE_MIN.items()}},
        "linear": [], "grouped": [], "linear_sweep": [], "grouped_sweep": [],
    }
    print(f"{result['gpu']} ({result['capability']}), torch {result['torch']}, torchao {result['torchao']}")
    header = f"{'model':<5} {'GEMM':<22} {'shape':<26} " + " ".join(f"{g:>7}" for g in (*GEMMS, "fwd+bwd")) + "  auto"
    print("\nlinears: speedup of fp8_rowwise over BF16 (quantization included)\n" + header)
    for model, name, k, n in LINEARS:
        row = {"model": model, "gemm": name, **bench_linear(args.tokens, k, n, args, extras=True)}
        result["linear"].append(row)
        print(f"{model:<5} {name:<22} {f'M={args.tokens} K={k} N={n}':<26} "
              + " ".join(f"{row['speedup'][g]:>7.2f}" for g in (*GEMMS, "fwd+bwd")) + f"  {row['auto_recipe']}")
    print("\ngrouped expert GEMMs\n" + header)
    for model, name, experts, m, k, n in GROUPED:
        row = {"model": model, "gemm": name, **bench_grouped(experts, m, k, n, args, extras=True)}
        result["grouped"].append(row)
        print(f"{model:<5} {name:<22} {f'E={experts} M={m} K={k} N={n}':<26} "
              + " ".join(f"{row['speedup'][g]:>7.2f}" for g in (*GEMMS, "fwd+bwd")) + f"  {row['auto_recipe']}")
    if not args.no_sweep:
        for d, tokens in itertools.product(SWEEP_DIMS, SWEEP_TOKENS):
            result["linear_sweep"].append(bench_linear(tokens, d, d, args, extras=False))
        for experts, m, k, n in GROUPED_SWEEP:
            result["grouped_sweep"].append(bench_grouped(experts, m, k, n, args, extras=False))
    linear_rows = [{**r, "tokens": r["M"]} for r in result["linear"] + result["linear_sweep"]]
    result["suggested_min_shape"] = {
        "linear": suggest_min_shape(linear_rows, "tokens"),
        "grouped": suggest_min_shape(result["grouped"] + result["grouped_sweep"], "tokens_per_expert"),
    }
    result["seconds"] = round(time.perf_counter() - began, 1)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nsuggested FP8_ROWWISE_MIN for moepass/fp8_recipe.py (then THRESHOLDS_SOURCE = {str(out)!r}):")
    for kind, s in result["suggested_min_shape"].items():
        print(f"    {kind!r}: MinShape(k={s['k']}, n={s['n']}, tokens={s['tokens']}),   # {s}")
    print(f"\nwrote {out} in {result['seconds']} s. The training step, FP8 recipe against BF16 Inductor:\n"
          "    moepass bench --flavor 16B --layers 4 --batch 8 --seq 4096 --steps 12 "
          "--variants inductor,all --options '{\"recipe\": \"fp8_rowwise\"}' --out examples/results/step_16B_h200")
    return 0


if __name__ == "__main__":
    sys.exit(main())
