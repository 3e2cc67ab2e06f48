"""Per-GEMM speed of the FP8-rowwise recipe against BF16 on one Hopper GPU, as training runs it: compiled.

    python examples/bench_fp8_gemms.py --out examples/results/fp8_gemms_h200.json

For the DeepSeek-V3 16B and 671B linears and routed-expert GEMMs that carry the FLOPs it times, with CUDA
events (median of --iters after warm-up), one line per GEMM as it goes (the JSON is rewritten after each):
  bf16         F.linear's three GEMMs (torch.mm) / torch._grouped_mm's three
  fp8_rowwise  the moepass::fp8_rowwise_* ops under torch.compile with moepass's decompositions, as the
               moepass backend compiles them: Inductor fuses the rowwise quantization into one kernel per
               operand, torch._scaled_mm / _scaled_grouped_mm do the GEMMs. One graph per GEMM (fwd, dgrad,
               wgrad), static shapes; the grouped wgrad is the opaque op (Triton token-group quantization).
               fwd+bwd = fwd + dgrad + wgrad (--train-step also times a compiled forward+backward).
  fp8_gemm     the FP8 GEMMs alone on pre-quantized operands (so quantization = fp8_rowwise - fp8_gemm);
               for linears also without fast accumulation
and reports TFLOP/s, speedups, SQNR against fp32, the recipe moepass picks for each GEMM and a suggested
FP8_ROWWISE_MIN for moepass/recipes/auto.py. Opt-in: --eager (the ops uncompiled), --blockwise (torchao's
DeepSeek-V3 blockwise recipe, and moepass's recipe="blockwise" ops), --sweep (the size sweep behind the
thresholds), --autotune (let Inductor autotune Triton templates against aten's _scaled_mm, as a default-mode
training compile does; slower).
The whole-training-step comparison is `moepass bench` (the command is printed at the end).

    python examples/bench_fp8_gemms.py --auto-table

re-derives the table recipe="auto" reads on Hopper (moepass/recipes/fp8_auto_table_h200.json, see
moepass/recipes/auto_table.py): every linear above (and the dense FFNs) at each of --tokens-list, and the routed
expert MLP of each flavor in context (gather, w1, w3, SiLU*up, w2, forward and backward, compiled) at each of
--tokens-per-expert-list, each against BF16 compiled the same way.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import pathlib
import shlex
import sys
import time

import torch
import torch.nn.functional as F

import moepass.ops  # noqa: F401  (registers torch.ops.moepass.fp8_rowwise_*)
from moepass.harness.provenance import git_commit, package_version
from moepass.ops.lowp.fp8_rowwise import decomp
from moepass.ops.lowp.fp8_rowwise.kernels.scaled_gemms import GROUPED_FAST_ACCUM, LINEAR_FAST_ACCUM
from moepass.recipes import auto
from moepass.recipes import auto_table as fp8_auto_table
from moepass.recipes.measure import median_ms

ops = torch.ops.moepass
BF16 = torch.bfloat16
SCHEMA = "moepass.bench_fp8_gemms/2"  # /2: fp8_rowwise_* times are the compiled (decomposed) path
GEMMS = ("fwd", "dgrad", "wgrad")
DEVICE = "cuda"

# (model, GEMM, K, N): y[M, N] = x[M, K] @ W[N, K].T, from models/config.py's 16B and 671B flavors.
# Attention and shared experts run in every layer; the dense FFN (first layer(s) only) is in MORE_LINEARS.
LINEARS = [
    ("16B", "attention.wq", 2048, 3072), ("16B", "attention.wkv_a", 2048, 576),
    ("16B", "attention.wkv_b", 512, 4096), ("16B", "attention.wo", 2048, 2048),
    ("16B", "shared_experts.w1|w3", 2048, 2816), ("16B", "shared_experts.w2", 2816, 2048),
    ("671B", "attention.wq_a", 7168, 1536), ("671B", "attention.wq_b", 1536, 24576),
    ("671B", "attention.wkv_b", 512, 32768), ("671B", "attention.wo", 16384, 7168),
    ("671B", "shared_experts.w1|w3", 7168, 2048), ("671B", "shared_experts.w2", 2048, 7168),
]
MORE_LINEARS = [
    ("16B", "dense_ffn.w1|w3", 2048, 10944), ("16B", "dense_ffn.w2", 10944, 2048),
    ("671B", "attention.wkv_a", 7168, 576), ("671B", "dense_ffn.w1|w3", 7168, 18432),
    ("671B", "dense_ffn.w2", 18432, 7168),
]
# (model, GEMM, experts on this GPU, routed rows M, K, N). 16B: 64 experts (top-6) on one GPU, M = 32768
# tokens * 6 (`moepass bench --batch 8 --seq 4096`: 3072 tokens per expert); 671B: one expert-parallel
# rank's 32 of 256 experts (top-8) at 2048 tokens per expert.
GROUPED = [
    ("16B", "experts.w1|w3", 64, 196608, 2048, 1408), ("16B", "experts.w2", 64, 196608, 1408, 2048),
    ("671B", "experts.w1|w3", 32, 65536, 7168, 2048), ("671B", "experts.w2", 32, 65536, 2048, 7168),
]
MORE_GROUPED = [
    ("16B", "experts.w1|w3", 64, 65536, 2048, 1408), ("16B", "experts.w2", 64, 65536, 1408, 2048),
    ("671B", "experts.w1|w3", 16, 16384, 7168, 2048), ("671B", "experts.w2", 16, 16384, 2048, 7168),
]
SWEEP_DIMS, SWEEP_TOKENS = (512, 1024, 2048, 4096), (1024, 4096, 16384)
GROUPED_SWEEP = [(16, tokens_per_expert * 16, d, d) for d in (1024, 2048) for tokens_per_expert in (128, 512, 2048)]


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median CUDA-event time of fn() over `iters` runs, as recipe="auto" measures on a GPU with no table."""
    return median_ms(fn, warmup, iters)


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


# ---- the compiled FP8 path: the ops decomposed exactly as the moepass backend hands them to Inductor ----

def compiled(fn, autotune: bool):
    """torch.compile(fn) through compile_fx with moepass's decomposition table, static shapes."""
    from torch._inductor.compile_fx import compile_fx

    table = decomp.inductor_decompositions()
    # Default-mode Inductor autotunes _scaled_mm against Triton templates: seconds per shape at compile time.
    patches = {} if autotune else {"max_autotune_gemm_backends": "ATEN"}

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=table)

    return torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)


def linear_fwd(x, w):
    return ops.fp8_rowwise_linear(x, w, None, False, "scaled_mm")


def linear_dgrad(g, w):
    return ops.fp8_rowwise_linear_dgrad(g, w, "scaled_mm")


def linear_wgrad(g, x):
    return ops.fp8_rowwise_linear_wgrad(g, x, "scaled_mm")


def grouped_fwd(x, w_t, offs):
    return ops.fp8_rowwise_grouped_mm(x, w_t, offs, False, "scaled_mm")


def grouped_dgrad(g, w_t, offs):
    return ops.fp8_rowwise_grouped_mm_dgrad(g, w_t, offs, "scaled_mm")


def grouped_wgrad(g, x, offs):
    return ops.fp8_rowwise_grouped_mm_wgrad(g, x, offs, "scaled_mm")


def compile_gemms(fns: dict, args: dict, autotune: bool) -> tuple[dict, dict, float]:
    """(compiled fns, their first outputs, compile seconds): one graph per GEMM, compiled on first call."""
    began = time.perf_counter()
    torch._dynamo.reset()  # each shape compiles fresh: no recompile limits, no guards piling up
    done = {name: compiled(fn, autotune) for name, fn in fns.items()}
    outs = {name: fn(*args[name]) for name, fn in done.items()}
    torch.cuda.synchronize()
    return done, outs, round(time.perf_counter() - began, 2)


def train_step_ms(fn, bf16_fn, leaves, grad_out, run) -> dict:
    """Compiled forward + backward (dgrad and wgrad in one backward graph) against BF16 autograd."""
    fp8 = run(lambda: torch.autograd.grad(fn(*leaves), leaves[:2], grad_out))
    bf16 = run(lambda: torch.autograd.grad(bf16_fn(*leaves), leaves[:2], grad_out))
    return {"bf16_ms": round(bf16, 4), "fp8_rowwise_ms": round(fp8, 4), "speedup": round(bf16 / fp8, 3)}


# ---- linears ------------------------------------------------------------------------------------

def bench_linear(m: int, k: int, n: int, args, extras: bool) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(m + k + n)
    x = torch.randn(m, k, device=DEVICE, dtype=BF16, generator=gen)
    w = (torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(BF16)
    g = torch.randn(m, n, device=DEVICE, dtype=BF16, generator=gen)
    run = lambda fn: time_ms(fn, args.warmup, args.iters)  # noqa: E731
    bf16 = {"fwd": run(lambda: torch.mm(x, w.t())), "dgrad": run(lambda: torch.mm(g, w)),
            "wgrad": run(lambda: torch.mm(g.t(), x))}
    operands = {"fwd": (x, w), "dgrad": (g, w), "wgrad": (g, x)}
    fns, outs, compile_s = compile_gemms({"fwd": linear_fwd, "dgrad": linear_dgrad, "wgrad": linear_wgrad},
                                         operands, args.autotune)
    fp8 = {name: run(lambda fn=fn, a=operands[name]: fn(*a)) for name, fn in fns.items()}
    row = {"M": m, "K": k, "N": n, **summarize(bf16, fp8, 2.0 * m * k * n), "compile_s": compile_s}
    recipe, reason = auto.choose_recipe(DEVICE, "linear", m, k, n)
    row["auto_recipe"], row["auto_reason"] = recipe, reason
    if not extras:
        return row
    # The eager ops run the same torch code (unfused) and the same GEMM: the compiled path must equal them.
    eager = {"fwd": linear_fwd(x, w), "dgrad": linear_dgrad(g, w), "wgrad": linear_wgrad(g, x)}
    row["bitwise_equal_to_eager_op"] = {name: bool(torch.equal(outs[name], eager[name])) for name in GEMMS}
    if args.eager:
        row["fp8_rowwise_eager_ms"] = {name: round(run(lambda fn=fn, a=operands[name]: fn(*a)), 4)
                                       for name, fn in (("fwd", linear_fwd), ("dgrad", linear_dgrad),
                                                        ("wgrad", linear_wgrad))}
    # The FP8 GEMMs alone, with and without fast accumulation: what quantization and promotion cost.
    xp, gp = decomp.pad_tokens(x), decomp.pad_tokens(g)
    (x_q, x_s), (w_q, w_s), (g_q, g_s) = decomp.rows(xp), decomp.rows(w), decomp.rows(gp)
    (wc_q, wc_s), (gc_q, gc_s), (xc_q, xc_s) = decomp.cols(w), decomp.cols(gp), decomp.cols(xp)
    quantized = {"fwd": (x_q, x_s, w_q.t(), w_s.t()), "dgrad": (g_q, g_s, wc_q, wc_s),
                 "wgrad": (gc_q.t(), gc_s.t(), xc_q, xc_s)}
    gemm = {}
    for fast in (True, False):
        for name, (a, sa, b, sb) in quantized.items():
            ia, ib = sa.reciprocal(), sb.reciprocal()
            gemm[f"{name}{'' if fast else '_no_fast_accum'}"] = round(run(
                lambda a=a, b=b, ia=ia, ib=ib, fast=fast: torch._scaled_mm(
                    a, b, scale_a=ia, scale_b=ib, out_dtype=BF16, use_fast_accum=fast)), 4)
    row["fp8_gemm_ms"] = gemm
    row["quantization_ms"] = {name: round(fp8[name] - gemm[name if LINEAR_FAST_ACCUM[name] else
                                                            f"{name}_no_fast_accum"], 4) for name in GEMMS}
    ref = {"fwd": x.float() @ w.float().t(), "dgrad": g.float() @ w.float(), "wgrad": g.float().t() @ x.float()}
    row["sqnr_db"] = {name: sqnr_db(ref[name], outs[name]) for name in GEMMS}
    if args.train_step:
        leaves = (x.detach().requires_grad_(), w.detach().requires_grad_())
        step = compiled(linear_fwd, args.autotune)
        row["train_step"] = train_step_ms(step, lambda a, b: torch.nn.functional.linear(a, b), leaves, g, run)
    if args.blockwise:
        row["blockwise"] = bench_blockwise_linear(x, w, g, run)
    return row


def bench_blockwise_linear(x, w, g, run) -> dict:
    """torchao's DeepSeek-V3 blockwise linear (1x128 activations, 128x128 weights), forward and backward; and
    moepass's recipe="blockwise" ops on the same operands ("moepass")."""
    if x.shape[1] % 128 or w.shape[0] % 128:
        return {"skipped": "K and N must be multiples of 128 for 128x128 weight blocks"}
    row = {}
    try:
        from torchao.prototype.blockwise_fp8_training.linear import fp8_blockwise_mm

        xl = x.detach().requires_grad_()
        wl = w.detach().requires_grad_()
        fwd = run(lambda: fp8_blockwise_mm.apply(x, w, 128))
        both = run(lambda: fp8_blockwise_mm.apply(xl, wl, 128).backward(g))
        row.update(fwd_ms=round(fwd, 4), **{"dgrad+wgrad_ms": round(both - fwd, 4)})
    except Exception as e:  # noqa: BLE001 - a missing kernel is a result, not a crash
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["moepass"] = bench_moepass_blockwise(False, run, {
        "fwd": lambda kernel: ops.blockwise_linear(x, w, None, False, kernel),
        "dgrad": lambda kernel: ops.blockwise_linear_dgrad(g, w, kernel),
        "wgrad": lambda kernel: ops.blockwise_linear_wgrad(g, x, kernel)})
    return row


def bench_moepass_blockwise(grouped: bool, run, gemms: dict) -> dict:
    """moepass::blockwise_* ops with the kernel moepass picks on this device, called as a compiled graph calls them
    (they are opaque to Inductor, quantization inside): ms per GEMM."""
    from moepass.ops.lowp.blockwise.kernels.choice import choose_blockwise_kernel

    kernel, why = choose_blockwise_kernel(DEVICE, grouped)
    if kernel is None:
        return {"skipped": why}
    try:
        return {"kernel": kernel, "why": why, "ms": {name: round(run(lambda fn=fn: fn(kernel)), 4)
                                                     for name, fn in gemms.items()}}
    except Exception as e:  # noqa: BLE001
        return {"kernel": kernel, "error": f"{type(e).__name__}: {e}"[:300]}


# ---- grouped expert GEMMs -------------------------------------------------------------------------

def routed_group_sizes(experts: int, rows: int, seed: int) -> list[int]:
    """Uneven token groups as a softmax router gives them (multinomial draws, sizes not multiples of 16)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(experts, generator=gen) * 0.5, 0)
    return torch.bincount(torch.multinomial(probs, rows, replacement=True, generator=gen), minlength=experts).tolist()


def grouped_reference(x, w_t, g, sizes) -> dict:
    ref = {"fwd": torch.zeros(x.shape[0], w_t.shape[2], device=x.device),
           "dgrad": torch.zeros(x.shape, device=x.device), "wgrad": torch.zeros(w_t.shape, device=x.device)}
    start = 0
    for e, end in enumerate(itertools.accumulate(sizes)):
        xs, gs, we = x[start:end].float(), g[start:end].float(), w_t[e].float()
        ref["fwd"][start:end], ref["dgrad"][start:end], ref["wgrad"][e] = xs @ we, gs @ we.t(), xs.t() @ gs
        start = end
    return ref


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
    operands = {"fwd": (x, w_t, offs), "dgrad": (g, w_t, offs), "wgrad": (g, x, offs)}
    fns, outs, compile_s = compile_gemms({"fwd": grouped_fwd, "dgrad": grouped_dgrad}, operands, args.autotune)
    fns["wgrad"] = grouped_wgrad  # not decomposed: compiled, it is this same op call
    outs["wgrad"] = grouped_wgrad(*operands["wgrad"])
    fp8 = {name: run(lambda fn=fn, a=operands[name]: fn(*a)) for name, fn in fns.items()}
    row = {"experts": experts, "M": m, "K": k, "N": n, "tokens_per_expert": m // experts,
           "group_sizes_min_max": [min(sizes), max(sizes)], **summarize(bf16, fp8, 2.0 * m * k * n),
           "compile_s": compile_s}
    recipe, reason = auto.choose_recipe(DEVICE, "grouped", m, k, n, experts=experts)
    row["auto_recipe"], row["auto_reason"] = recipe, reason
    if not extras:
        return row
    if args.eager:  # the uncompiled ops: torchao's autotuned Triton quantization kernels
        row["fp8_rowwise_eager_ms"] = {name: round(run(lambda fn=fn, a=operands[name]: fn(*a)), 4)
                                       for name, fn in (("fwd", grouped_fwd), ("dgrad", grouped_dgrad))}
    from moepass.ops.lowp.fp8_rowwise.kernels.triton_token_group_cols import token_group_cols_padded

    (x_q, x_s), (g_q, g_s) = decomp.rows(x), decomp.rows(g)
    (wk_q, wk_s), (wn_q, wn_s) = decomp.cols(w_t), decomp.rows(w_t)
    gt_q, gt_s, padded_ends = token_group_cols_padded(g, offs)
    xt_q, xt_s, _ = token_group_cols_padded(x, offs)
    quantized = {"fwd": (x_q, x_s.reshape(-1), wk_q, wk_s.squeeze(1), offs),
                 "dgrad": (g_q, g_s.reshape(-1), wn_q.transpose(-2, -1), wn_s.squeeze(-1), offs),
                 "wgrad": (gt_q, gt_s.reshape(-1), xt_q.t(), xt_s.reshape(-1), padded_ends)}
    gemm = {}
    for name, (a, sa, b, sb, o) in quantized.items():
        ia, ib = sa.reciprocal(), sb.reciprocal()
        gemm[name] = round(run(lambda a=a, b=b, ia=ia, ib=ib, o=o: torch._scaled_grouped_mm(
            a, b, ia, ib, o, out_dtype=BF16, use_fast_accum=GROUPED_FAST_ACCUM)), 4)
    row["fp8_gemm_ms"] = gemm
    row["quantization_ms"] = {name: round(fp8[name] - gemm[name], 4) for name in GEMMS}
    ref = grouped_reference(x, w_t, g, sizes)
    row["sqnr_db"] = {name: sqnr_db(ref[name], outs[name]) for name in GEMMS}
    if args.blockwise:
        row["blockwise"] = bench_blockwise_grouped(x, w_t, offs, g, run)
    return row


def bench_blockwise_grouped(x, w_t, offs, g, run) -> dict:
    """torchao's blockwise FP8 grouped GEMM (it needs DeepGEMM on Hopper); recorded as an error where absent. And
    moepass's recipe="blockwise" grouped ops on the same operands ("moepass")."""
    if w_t.shape[1] % 128 or w_t.shape[2] % 128:
        return {"skipped": "K and N must be multiples of 128 for 128x128 weight blocks"}
    row = {}
    try:
        from torchao.prototype.moe_training.blockwise_fp8.grouped_mm import _to_fp8_blockwise_then_scaled_grouped_mm

        w_c = w_t.detach().requires_grad_()
        x_c = x.detach().requires_grad_()
        fwd = run(lambda: _to_fp8_blockwise_then_scaled_grouped_mm(x, w_t, offs=offs))
        both = run(lambda: _to_fp8_blockwise_then_scaled_grouped_mm(x_c, w_c, offs=offs).backward(g))
        row.update(fwd_ms=round(fwd, 4), **{"dgrad+wgrad_ms": round(both - fwd, 4)})
    except Exception as e:  # noqa: BLE001
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    row["moepass"] = bench_moepass_blockwise(True, run, {
        "fwd": lambda kernel: ops.blockwise_grouped_mm(x, w_t, offs, False, kernel),
        "dgrad": lambda kernel: ops.blockwise_grouped_mm_dgrad(g, w_t, offs, kernel),
        "wgrad": lambda kernel: ops.blockwise_grouped_mm_wgrad(g, x, offs, kernel)})
    row["gemm_only_ms"] = bench_blockwise_grouped_gemms(x, w_t, offs, g, run)
    return row


def bench_blockwise_grouped_gemms(x, w_t, offs, g, run) -> dict:
    """The three grouped GEMMs alone on operands quantized beforehand, for every blockwise grouped kernel that runs
    here ("scaled_mm": one torch._scaled_mm per token group; "triton": moepass's two Triton kernels)."""
    from moepass.ops.lowp.blockwise import grouped_mm, quant
    from moepass.ops.lowp.blockwise.kernels import choice, gemm

    operands = {"fwd": grouped_mm.forward_operands(*quant.quantize_tiles(x), w_t, offs),
                "dgrad": grouped_mm.dgrad_operands(g, w_t, offs),
                "wgrad": grouped_mm.wgrad_operands(g, x, offs)}
    out = {}
    for kernel in ("scaled_mm", "triton"):
        problem = choice.kernel_problem(kernel, torch.device(DEVICE), True)
        if problem:
            out[kernel] = {"skipped": problem}
            continue
        out[kernel] = {name: round(run(lambda a=a: gemm.grouped_mm_nt(*a, kernel)), 4) for name, a in operands.items()}
    return out


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


def suggestions(result: dict) -> dict:
    linear_rows = [{**r, "tokens": r["M"]} for r in result["linear"] + result["linear_sweep"]]
    return {"linear": suggest_min_shape(linear_rows, "tokens") if linear_rows else None,
            "grouped": (suggest_min_shape(result["grouped"] + result["grouped_sweep"], "tokens_per_expert")
                        if result["grouped"] + result["grouped_sweep"] else None)}


# ---- the table recipe="auto" reads (--auto-table) ----------------------------------------------------

# (flavor, dim, moe_inter_dim) of the routed experts, measured as a whole MLP on AUTO_EXPERTS experts
AUTO_MLPS = [("16B", 2048, 1408), ("671B", 7168, 2048)]
AUTO_EXPERTS, AUTO_TOP_K = 16, 8


def expert_mlp(fp8: bool, received: bool = False):
    """The routed experts as a MoE layer runs them: gather the routed tokens, w1 and w3, SiLU*up, w2.

    The FP8 version calls the op the grouped_mm pass writes under recipe="auto" (FP8 forward and dgrad, the wgrad
    as auto.WGRAD_BF16_AUTO says: FP8 now, BF16 when the shipped table was measured); compiled, Inductor fuses the
    activations' quantization into the gather and the SiLU*up, as in a model.
    x is quantized after its gather here (T * top_k rows), as without the quantize_once pass; the default pipeline
    quantizes it once on the T token rows and gathers FP8 rows. The 16B curve was checked against that in the model
    (examples/results/bench_16B_per_layer_routed_fp8_h200/: routed experts in FP8 within the step's noise), so the
    table still stands for it; a rows-form curve is not measured.
    received: the same rows through a nonzero, so their count is data dependent, as after an EP exchange.
    """
    def gemm(a, w, offs):
        w_t = w.transpose(-2, -1)
        if fp8:
            return ops.fp8_rowwise_grouped_mm(a, w_t, offs, auto.WGRAD_BF16_AUTO["grouped"], "scaled_mm")
        return torch._grouped_mm(a, w_t, offs=offs)

    def mlp(hidden, idx, w1, w3, w2, offs):
        if received:
            idx = idx[(idx >= 0).nonzero().squeeze(-1)]  # every row, but M is now an unbacked SymInt
        x = hidden[idx]
        return gemm(F.silu(gemm(x, w1, offs)) * gemm(x, w3, offs), w2, offs)

    return mlp


def bench_expert_mlp(dim: int, inter: int, tokens_per_expert: int, args, received: bool = False) -> dict:
    experts = AUTO_EXPERTS
    m = experts * tokens_per_expert
    sizes = routed_group_sizes(experts, m, seed=dim + m)
    gen = torch.Generator(device=DEVICE).manual_seed(dim + inter + m)
    hidden = torch.randn(m // AUTO_TOP_K, dim, device=DEVICE, dtype=BF16, generator=gen).requires_grad_()
    idx = torch.randint(0, m // AUTO_TOP_K, (m,), device=DEVICE, generator=gen)
    w1, w3 = ((torch.randn(experts, inter, dim, device=DEVICE, generator=gen) / dim**0.5).to(BF16).requires_grad_()
              for _ in range(2))
    w2 = (torch.randn(experts, dim, inter, device=DEVICE, generator=gen) / inter**0.5).to(BF16).requires_grad_()
    offs = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    grad_out = torch.randn(m, dim, device=DEVICE, dtype=BF16, generator=gen)
    leaves = (hidden, w1, w3, w2)
    run = lambda fn: time_ms(fn, args.warmup, args.iters)  # noqa: E731
    row = {"dim": dim, "inter": inter, "experts": experts, "tokens_per_expert": tokens_per_expert,
           "group_sizes_min_max": [min(sizes), max(sizes)]}
    began = time.perf_counter()
    torch._dynamo.reset()
    for name, fp8 in (("bf16", False), ("fp8", True)):
        fn = compiled(expert_mlp(fp8, received), args.autotune)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=received):  # the nonzero traced, no break
            row[f"{name}_ms"] = round(run(lambda fn=fn: torch.autograd.grad(
                fn(hidden, idx, w1, w3, w2, offs), leaves, grad_out)), 4)
    row["speedup"] = round(row["bf16_ms"] / row["fp8_ms"], 3)
    row["seconds"] = round(time.perf_counter() - began, 1)
    return row


def auto_table(args) -> int:
    """Measure and write the table recipes/auto_table reads; the rows are printed as they come."""
    began = time.perf_counter()
    cc = torch.cuda.get_device_capability()
    models = args.models.split(",")
    table = {"schema": fp8_auto_table.SCHEMA, **provenance(cc),
             "capability": list(cc), "settings": {"iters": args.iters, "warmup": args.warmup,
                                                  "expert_mlp": {"experts": AUTO_EXPERTS, "top_k": AUTO_TOP_K,
                                                                 "wgrad": "BF16" if auto.WGRAD_BF16_AUTO["grouped"]
                                                                 else "FP8"}},
             "linear": [], "grouped": [], "grouped_received": []}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every row: a run cut short keeps what it measured
        table["seconds"] = round(time.perf_counter() - began, 1)
        out.write_text(json.dumps(table, indent=1) + "\n")

    tokens_list = [int(t) for t in args.tokens_list.split(",")]
    print(f"{table['gpu']} ({table['capability']}), torch {table['torch']}: fwd+dgrad+wgrad speedup of compiled "
          "FP8 rowwise over BF16, quantization included")
    for model, name, k, n in LINEARS + MORE_LINEARS:
        if model not in models:
            continue
        for tokens in tokens_list:
            r = bench_linear(tokens, k, n, args, extras=False)
            bf16, fp8 = sum(r["bf16_ms"].values()), sum(r["fp8_rowwise_ms"].values())
            table["linear"].append({"model": model, "gemm": name, "K": k, "N": n, "tokens": tokens,
                                    "bf16_ms": round(bf16, 4), "fp8_ms": round(fp8, 4),
                                    "speedup": r["speedup"]["fwd+bwd"], "compile_s": r["compile_s"]})
            print(f"{model:<5} {name:<22} K={k:<6} N={n:<6} M={tokens:<6} {r['speedup']['fwd+bwd']:6.3f}x", flush=True)
            save()
    for model, dim, inter in AUTO_MLPS:
        if model not in models:
            continue
        for per_expert in (int(t) for t in args.tokens_per_expert_list.split(",")):
            r = {"model": model, **bench_expert_mlp(dim, inter, per_expert, args)}
            table["grouped"].append(r)
            received = {"model": model, **bench_expert_mlp(dim, inter, per_expert, args, received=True)}
            table["grouped_received"].append(received)
            print(f"{model:<5} expert MLP dim={dim} inter={inter} tokens/expert={per_expert:<5} {r['speedup']:6.3f}x "
                  f"(received rows {received['speedup']:6.3f}x)", flush=True)
            save()
    save()
    fp8_auto_table.AutoTable(table, str(out))  # the file must load as recipe="auto" will read it
    print(f"wrote {out} in {table['seconds']} s")
    return 0


def received_rows(args) -> int:
    """--received-rows: each expert MLP with static rows and with the same rows made data dependent (EP's case:
    the op stays opaque there, and recipe="auto" reads the table's grouped_received curve), side by side."""
    began = time.perf_counter()
    result = {"schema": "moepass.bench_fp8_received_rows/1", **provenance(torch.cuda.get_device_capability()),
              "settings": {"iters": args.iters, "warmup": args.warmup, "experts": AUTO_EXPERTS, "top_k": AUTO_TOP_K},
              "rows": []}
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    print("expert MLP, fwd+bwd, FP8 rowwise over BF16: static row count | data-dependent row count")
    for model, dim, inter in AUTO_MLPS:
        if model not in args.models.split(","):
            continue
        for per_expert in (int(t) for t in args.tokens_per_expert_list.split(",")):
            static, received = (bench_expert_mlp(dim, inter, per_expert, args, received=r) for r in (False, True))
            result["rows"].append({"model": model, "static": static, "received": received})
            print(f"{model:<5} dim={dim} inter={inter} tokens/expert={per_expert:<5} {static['speedup']:6.3f}x "
                  f"({static['fp8_ms']:.2f} ms) | {received['speedup']:6.3f}x ({received['fp8_ms']:.2f} ms)", flush=True)
            result["seconds"] = round(time.perf_counter() - began, 1)
            out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


# ---- provenance and main ------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON to write (default examples/results/fp8_gemms_h200.json)")
    p.add_argument("--tokens", type=int, default=16384, help="M (tokens) of the DeepSeek-V3 linears")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--models", default="16B,671B", help="comma-separated flavors to measure")
    p.add_argument("--more-shapes", action="store_true", help="also the dense FFNs and smaller expert batches")
    p.add_argument("--no-grouped", action="store_true", help="linears only")
    p.add_argument("--no-linear", action="store_true", help="grouped expert GEMMs only")
    p.add_argument("--sweep", action="store_true", help="also the size sweep behind the thresholds (slow)")
    p.add_argument("--eager", action="store_true", help="also time the ops uncompiled")
    p.add_argument("--train-step", action="store_true", help="also time a compiled linear forward+backward")
    p.add_argument("--blockwise", action="store_true",
                   help="also time torchao's blockwise FP8 recipe and moepass's (recipe=blockwise) ops")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new GEMM after this many seconds (0: no limit; default 90, none with --sweep); "
                        "the 16B shapes run first")
    p.add_argument("--auto-table", action="store_true",
                   help="measure the table recipe=auto reads (per GEMM and token count) into --out "
                        f"(default {fp8_auto_table.SHIPPED_NAME})")
    p.add_argument("--tokens-list", default="4096,8192,16384,32768", help="--auto-table: M of the linears")
    p.add_argument("--tokens-per-expert-list", default="512,1024,2048,4096",
                   help="--auto-table: tokens per expert of the expert MLPs")
    p.add_argument("--received-rows", action="store_true",
                   help="the expert MLPs of --tokens-per-expert-list with static and with data-dependent row counts "
                        "(as after an EP exchange), into --out")
    p.add_argument("--autotune", action="store_true",
                   help="let Inductor autotune _scaled_mm against Triton templates (default: aten's kernel)")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = str(fp8_auto_table.SHIPPED) if args.auto_table else "examples/results/fp8_gemms_h200.json"
    if args.budget_s is None:
        args.budget_s = 0.0 if args.sweep else 90.0
    return args


def shape_lists(args) -> tuple[list, list]:
    models = set(args.models.split(","))
    linears = [] if args.no_linear else LINEARS + (MORE_LINEARS if args.more_shapes else [])
    grouped = [] if args.no_grouped else GROUPED + (MORE_GROUPED if args.more_shapes else [])
    return [s for s in linears if s[0] in models], [s for s in grouped if s[0] in models]


def jobs(args) -> list[tuple[str, tuple]]:
    """("linear" | "grouped", shape) in the order they run: model by model (16B first), then the sweep."""
    linears, grouped = shape_lists(args)
    order = [m for m in ("16B", "671B") if m in args.models.split(",")]
    out = [(kind, s) for model in order for kind, shapes in (("linear", linears), ("grouped", grouped))
           for s in shapes if s[0] == model]
    if args.sweep:
        out += [("linear_sweep", ("sweep", "linear", d, d, tokens))
                for d, tokens in itertools.product(SWEEP_DIMS, SWEEP_TOKENS)]
        out += [("grouped_sweep", ("sweep", "grouped", *shape)) for shape in GROUPED_SWEEP]
    return out


def format_row(model: str, name: str, shape: str, row: dict) -> str:
    return (f"{model:<5} {name:<22} {shape:<30} " + " ".join(f"{row['speedup'][g]:>7.2f}" for g in (*GEMMS, "fwd+bwd"))
            + f"  {sum(row['fp8_rowwise_ms'].values()):>7.3f} {row['compile_s']:>6.1f}  {row['auto_recipe']}")


HEADER = (f"{'model':<5} {'GEMM':<22} {'shape':<30} " + " ".join(f"{g:>7}" for g in (*GEMMS, "fwd+bwd"))
          + f"  {'fp8 ms':>7} {'comp s':>6}  auto")


def provenance(cc: tuple[int, int]) -> dict:
    return {"gpu": torch.cuda.get_device_name(), "capability": f"sm_{cc[0]}{cc[1]}",
            "torch": torch.__version__, "torchao": package_version("torchao"), "triton": package_version("triton"),
            "cuda": torch.version.cuda, "commit": git_commit()["commit"],
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def save_json(result: dict, path: str) -> None:
    """Write a kernel benchmark's result (its folder made if missing) and say where."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemms: needs a CUDA GPU (sm_89+; grouped GEMMs sm_90)", file=sys.stderr)
        return 2
    if args.auto_table:
        return auto_table(args)
    if args.received_rows:
        return received_rows(args)
    began = time.perf_counter()
    cc = torch.cuda.get_device_capability()
    result = {
        "schema": SCHEMA, **provenance(cc),
        "settings": {"tokens": args.tokens, "iters": args.iters, "warmup": args.warmup, "budget_s": args.budget_s,
                     "fp8_rowwise_path": "torch.compile + moepass decompositions (Inductor), static shapes",
                     "scaled_mm_autotune": args.autotune,
                     "linear_fast_accum": LINEAR_FAST_ACCUM, "grouped_fast_accum": GROUPED_FAST_ACCUM,
                     "thresholds_in_use": {kind: vars(v) for kind, v in auto.FP8_ROWWISE_MIN.items()}},
        "linear": [], "grouped": [], "linear_sweep": [], "grouped_sweep": [],
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every row, so a run cut short still leaves what it measured
        result["suggested_min_shape"] = suggestions(result)
        result["seconds"] = round(time.perf_counter() - began, 1)
        out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{result['gpu']} ({result['capability']}), torch {result['torch']}, torchao {result['torchao']}")
    print("\nspeedup of compiled fp8_rowwise over BF16 (quantization included), fp8 ms = fwd+dgrad+wgrad\n" + HEADER)
    result["skipped_for_time"] = []
    for kind, shape in jobs(args):
        if args.budget_s and time.perf_counter() - began > args.budget_s:  # a cut-short run still reports
            result["skipped_for_time"].append([kind, list(shape)])
            continue
        model, name = shape[:2]
        if kind == "linear":
            k, n = shape[2:]
            row = {"model": model, "gemm": name, **bench_linear(args.tokens, k, n, args, extras=True)}
            label = f"M={args.tokens} K={k} N={n}"
        elif kind == "grouped":
            experts, m, k, n = shape[2:]
            row = {"model": model, "gemm": name, **bench_grouped(experts, m, k, n, args, extras=True)}
            label = f"E={experts} M={m} K={k} N={n}"
        elif kind == "linear_sweep":
            k, n, tokens = shape[2:]
            row, label = bench_linear(tokens, k, n, args, extras=False), f"M={tokens} K={k} N={n}"
        else:
            experts, m, k, n = shape[2:]
            row, label = bench_grouped(experts, m, k, n, args, extras=False), f"E={experts} M={m} K={k} N={n}"
        result[kind].append(row)
        print(format_row(model, name, label, row), flush=True)
        save()
    if result["skipped_for_time"]:
        print(f"\n--budget-s {args.budget_s} spent: skipped {len(result['skipped_for_time'])} GEMM(s) "
              "(listed in the JSON's skipped_for_time; rerun with --models or --budget-s 0)")
    save()
    print(f"\nsuggested FP8_ROWWISE_MIN for moepass/recipes/auto.py (then THRESHOLDS_SOURCE = {str(out)!r}):")
    for kind, s in result["suggested_min_shape"].items():
        if s is not None:
            print(f"    {kind!r}: MinShape(k={s['k']}, n={s['n']}, tokens={s['tokens']}),   # {s}")
    print(f"\nwrote {out} in {result['seconds']} s. The training step, FP8 recipe against BF16 Inductor:\n"
          "    moepass bench --device cuda --flavor 16B --layers 4 --batch 8 --seq 4096 --steps 10 --warmup 3 "
          "--variants inductor,all --options '{\"recipe\": \"fp8_rowwise\"}' --out examples/results/step_16B_h200")
    return 0


if __name__ == "__main__":
    sys.exit(main())
