"""The most an FP8 GEMM recipe could speed up a training step on this GPU: every GEMM at FP8 speed, for free.

    python examples/bench_fp8_bound.py --flavor 16B --layers 4 --batch 8 --seq 4096 \
        --out examples/results/fp8_bound_16B_h200/fp8_bound_16B_l4_h200.json

1. Records every GEMM of one eager BF16 training step (forward, loss, backward) of the model at its real
   shapes, strides and routed token groups (a TorchDispatchMode on aten.mm/addmm/bmm/_grouped_mm), so it
   works for any model `moepass bench` can build, including a user's (--model MODULE:FACTORY).
2. Times each distinct GEMM alone, side by side in this run:
     bf16        the recorded aten call, same strides;
     fp8         the same GEMM in float8 e4m3 on operands quantized beforehand, in the layouts FP8 needs
                 (so quantization, transposes and padding cost nothing), with fast accumulation:
                 linears: torch._scaled_mm tensorwise (the fastest FP8 GEMM torch has) and rowwise (moepass's
                 fp8_rowwise); grouped: torch._scaled_grouped_mm rowwise (the grouped FP8 GEMM on sm_90),
                 its wgrad's token groups padded to 16 rows; bmm: no FP8 form (counted as BF16).
3. Times the whole step as `moepass bench` does: BF16 Inductor and the moepass variants (--variants).
4. bound = BF16 step - sum over GEMMs of calls * max(0, bf16 - fp8): the step time of a recipe whose
   quantization is free and whose every GEMM (scope "all") or every GEMM but the output head ("no_head")
   runs at FP8 speed wherever that is faster. No recipe that puts these GEMMs in FP8 can beat it on this
   GPU; a goal above step_bf16 / bound cannot be met that way. Not counted: attention's own matmuls inside
   scaled_dot_product_attention (FP8 attention is a different recipe) and everything that is not a GEMM.
   The output head is the GEMM with the logits' vocabulary dimension; DeepSeek-V3's recipe keeps it BF16.
   The replayed BF16 GEMMs can run slower alone than inside the step (on the 16B step: 165 ms replayed vs
   150 ms of GEMM kernels in a profile), which only makes the bound more generous.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import json
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench_fp8_gemms import time_ms
from moepass.harness.bench import run_variant
from moepass.harness.corpus import Batches, load_corpus
from moepass.harness.flags import add_model_flags, model_spec
from moepass.harness.output import error_summary, json_safe, say
from moepass.harness.provenance import provenance
from moepass.harness.ranks import Ranks
from moepass.harness.timing import add_speedups
from moepass.harness.train import next_token_loss
from moepass.harness.variants import parse_custom_variant, resolve_variants
from moepass.ops.lowp.fp8_rowwise import decomp, quant
from moepass.ops.lowp.fp8_rowwise.kernels.scaled_gemms import scaled_grouped_mm

SCHEMA = "moepass.bench_fp8_bound/1"
aten = torch.ops.aten
GEMM_OPS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm",
            aten._grouped_mm.default: "grouped_mm"}


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One distinct GEMM call: aten op, operand shapes and strides, and for grouped_mm the group sizes."""

    op: str
    shapes: tuple
    strides: tuple
    groups: tuple | None = None  # tokens per group (from offs), grouped_mm only
    has_bias: bool = False

    @property
    def out_shape(self) -> tuple:
        (a, b) = self.shapes
        if self.op == "grouped_mm":
            if len(a) == 2 and len(b) == 2:
                return (len(self.groups), a[0], b[1])
            return (a[0], b[-1]) if len(a) == 2 else (a[0], a[1], b[-1])
        return (*a[:-1], b[-1])

    @property
    def flop(self) -> int:
        (a, b) = self.shapes
        if self.op == "grouped_mm" and len(a) == 2 and len(b) == 2:
            return 2 * a[0] * sum(self.groups) * b[1]  # K split into groups: every row of K used once
        if self.op == "grouped_mm" and len(a) == 2:
            return 2 * sum(self.groups) * a[1] * b[-1]  # rows past the last group are not computed
        batch = a[0] if len(a) == 3 else 1
        return 2 * batch * a[-2] * a[-1] * b[-1]

    def role(self, vocab: int | None) -> str:
        """head (a GEMM with the vocabulary dimension), grouped, linear (mm/addmm) or bmm."""
        if vocab is not None and any(vocab in s for s in self.shapes):
            return "head"
        return {"grouped_mm": "grouped", "bmm": "bmm"}.get(self.op, "linear")

    def describe(self) -> str:
        shapes = " x ".join("[" + ",".join(map(str, s)) + "]" + ("T" if _transposed(st) else "")
                            for s, st in zip(self.shapes, self.strides))
        return f"{self.op} {shapes}" + (f" {len(self.groups)} groups" if self.groups else "")


def _transposed(stride: tuple) -> bool:
    return len(stride) >= 2 and stride[-2] == 1 and stride[-1] != 1


class GemmRecorder(TorchDispatchMode):
    """Counts the GEMMs that reach aten (below autograd, so the backward's are seen too)."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[Gemm] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = GEMM_OPS.get(func)
        if op is not None:
            self.calls[_gemm(op, args, kwargs)] += 1
        return func(*args, **kwargs)


def _gemm(op: str, args, kwargs) -> Gemm:
    if op == "addmm":
        bias, a, b = args[:3]
        return Gemm(op, (tuple(a.shape), tuple(b.shape)), (a.stride(), b.stride()), has_bias=bias is not None)
    a, b = args[:2]
    groups = None
    if op == "grouped_mm":
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        if offs is None:
            raise ValueError("bench_fp8_bound: torch._grouped_mm without offs (a batched 3d-3d call) is not "
                             "supported; record a model whose experts pass offs")
        ends = offs.tolist()
        groups = tuple(e - s for s, e in zip([0, *ends[:-1]], ends))
    return Gemm(op, (tuple(a.shape), tuple(b.shape)), (a.stride(), b.stride()), groups)


def record_step_gemms(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[dict, int]:
    """{Gemm: calls} of one eager forward + loss + backward, and the vocabulary size (the logits' last dim)."""
    with GemmRecorder() as rec:
        logits = model(inputs)
        next_token_loss(logits, targets).backward()
    model.zero_grad(set_to_none=True)
    return dict(rec.calls), logits.shape[-1]


# ---- operands and replays ------------------------------------------------------------------------------

def operands(g: Gemm, device, seed: int = 0) -> list[torch.Tensor]:
    """BF16 operands with the recorded shapes and strides (and offs for grouped_mm, bias for addmm)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for shape, stride in zip(g.shapes, g.strides):
        order = sorted(range(len(shape)), key=lambda d: stride[d], reverse=True)  # outermost dim first
        dense = torch.randn([shape[d] for d in order], generator=gen, device=device, dtype=torch.bfloat16)
        out.append(dense.permute([order.index(d) for d in range(len(shape))]))  # strides as recorded if dense
    if g.op == "grouped_mm":
        out.append(torch.tensor(list(itertools.accumulate(g.groups)), dtype=torch.int32, device=device))
    if g.has_bias:
        out.insert(0, torch.randn(g.shapes[1][-1], generator=gen, device=device, dtype=torch.bfloat16))
    return out


def bf16_call(g: Gemm, args: list[torch.Tensor]):
    if g.op == "grouped_mm":
        a, b, offs = args
        return lambda: torch._grouped_mm(a, b, offs=offs)
    fn = {"mm": torch.mm, "addmm": torch.addmm, "bmm": torch.bmm}[g.op]
    return lambda: fn(*args)


def _tensorwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t -> e4m3 in t's shape, row-major, with one scale (a multiplier, as fp8_rowwise.quant's) for all of it."""
    q, scale = quant.quantize(t.reshape(1, -1), -1)
    return q.view(t.shape), scale.reshape(())


def fp8_calls(g: Gemm, args: list[torch.Tensor]) -> dict:
    """{form: call} of the same GEMM in FP8 on operands quantized here (not timed); {} where none exists.

    Operands are quantized by moepass's own code (ops/lowp/fp8_rowwise: quant, decomp, kernels/) into the layouts
    its ops hand the GEMMs; only fast accumulation is forced on everywhere (the fastest FP8 GEMM).
    """
    bias = args[0] if g.has_bias else None
    if g.op in ("mm", "addmm"):
        a, b = args[-2:]
        a_q, a_scale = decomp.rows(a)  # [M, K] row-major, [M, 1]
        b_q, b_scale = decomp.cols(b)  # [K, N] column-major, [1, N]
        at_q, at_scale = _tensorwise(a.contiguous())
        bt_q, bt_scale = _tensorwise(b.t().contiguous())

        def scaled_mm(aq, a_s, bq, b_s):
            return lambda: torch._scaled_mm(aq, bq, a_s.reciprocal(), b_s.reciprocal(), bias=bias,
                                            out_dtype=torch.bfloat16, use_fast_accum=True)

        return {"tensorwise": scaled_mm(at_q, at_scale, bt_q.t(), bt_scale),
                "rowwise": scaled_mm(a_q, a_scale, b_q, b_scale)}
    if g.op != "grouped_mm":
        return {}
    a, b, offs = args
    if a.dim() == 2 and b.dim() == 3:  # forward / dgrad: tokens [M, K] x per-expert [E, K, N]
        a_q, a_scale = decomp.rows(a)  # [M, K], [M, 1]
        b_q, b_scale = decomp.cols(b)  # [E, K, N] column-major, [E, 1, N]
        return {"rowwise": lambda: scaled_grouped_mm(a_q, a_scale.reshape(-1), b_q, b_scale.squeeze(1), offs)}
    if a.dim() == 2 and b.dim() == 2:  # wgrad: [K, M] x [M, N], token groups along M
        if a.device.type != "cuda":
            raise RuntimeError("the grouped wgrad's token-group quantization is a Triton kernel: CUDA only")
        from moepass.ops.lowp.fp8_rowwise.kernels.triton_token_group_cols import token_group_cols_padded  # its layout

        at_q, a_scale, ends = token_group_cols_padded(a.t(), offs)  # [K, P] row-major, [E, K], groups 16-aligned
        bt_q, b_scale, _ = token_group_cols_padded(b, offs)  # [N, P] row-major, [E, N]
        return {"rowwise": lambda: scaled_grouped_mm(at_q, a_scale.reshape(-1), bt_q.t(), b_scale.reshape(-1), ends)}
    return {}


# ---- the bound ---------------------------------------------------------------------------------------

def gemm_rows(calls: dict, vocab: int | None, timer, device) -> list[dict]:
    """One row per distinct GEMM: role, shape, calls per step, BF16 and FP8 milliseconds, best FP8 form."""
    rows = []
    for i, (g, n) in enumerate(sorted(calls.items(), key=lambda kv: -kv[0].flop * kv[1])):
        args = operands(g, device, seed=i)
        row = {"role": g.role(vocab), "gemm": g.describe(), "calls": n, "flop": g.flop,
               "bf16_ms": round(timer(bf16_call(g, args)), 4), "fp8_ms": {}}
        try:
            forms = fp8_calls(g, args)
        except RuntimeError as e:  # no FP8 form here (the grouped wgrad off CUDA): it stays BF16 in the bound
            forms, row["fp8_errors"] = {}, {"rowwise": str(e).splitlines()[0][:200]}
        for form, call in forms.items():
            try:
                row["fp8_ms"][form] = round(timer(call), 4)
            except RuntimeError as e:  # a shape or device the FP8 kernel refuses: it stays BF16 in the bound
                row.setdefault("fp8_errors", {})[form] = str(e).splitlines()[0][:200]
        best = min(row["fp8_ms"].values(), default=None)
        row["fp8_best_ms"] = best
        row["saved_ms_per_call"] = round(max(0.0, row["bf16_ms"] - best), 4) if best is not None else 0.0
        say(f"  {row['role']:<8} {g.describe():<58} x{n:<3} bf16 {row['bf16_ms']:8.3f} ms  fp8 "
            + " ".join(f"{k} {v:.3f}" for k, v in row["fp8_ms"].items()))
        rows.append(row)
        del args
    return rows


def bound(rows: list[dict], step_bf16_ms: float) -> dict:
    """Per scope: the GEMMs' BF16 ms per step, what free-quantization FP8 saves, the bound step and speedup."""
    out = {}
    for scope, keep in (("all", lambda r: True), ("no_head", lambda r: r["role"] != "head")):
        chosen = [r for r in rows if keep(r)]
        gemm_ms = sum(r["bf16_ms"] * r["calls"] for r in chosen)
        saved = sum(r["saved_ms_per_call"] * r["calls"] for r in chosen)
        step = step_bf16_ms - saved
        out[scope] = {"gemm_bf16_ms": round(gemm_ms, 2), "saved_ms": round(saved, 2), "bound_step_ms": round(step, 2),
                      "max_speedup": round(step_bf16_ms / step, 4) if step > 0 else None}
    out["gemm_share_of_step"] = round(out["all"]["gemm_bf16_ms"] / step_bf16_ms, 4)
    return out


# ---- main --------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flags(p, batch=8, seq=4096)
    p.set_defaults(flavor="16B", layers=4)
    p.add_argument("--steps", type=int, default=10, help="training steps per variant (as moepass bench)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--variants", default="inductor,all",
                   help="step variants, first is the BF16 baseline (default: inductor,all); '' skips the steps")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON", help="as moepass bench's")
    p.add_argument("--options", default=None, help="backend options for moepass variants, as JSON")
    p.add_argument("--step-bf16-ms", type=float, default=None,
                   help="use this BF16 step time instead of timing the steps (then --variants is ignored)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per GEMM (median)")
    p.add_argument("--out", default="fp8_bound.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise SystemExit("bench_fp8_bound: needs a CUDA GPU with FP8 tensor cores (sm_89 or newer); "
                         f"got {args.device}")
    result = measure(args, lambda fn: time_ms(fn, 5, args.iters))
    b = result["bound"]
    say(f"\nBF16 step {result['step_bf16_ms']:.1f} ms; its GEMMs alone {b['all']['gemm_bf16_ms']:.1f} ms "
        f"({b['gemm_share_of_step']:.0%}), the output head's "
        f"{b['all']['gemm_bf16_ms'] - b['no_head']['gemm_bf16_ms']:.1f} ms")
    for scope in ("all", "no_head"):
        say(f"bound ({scope:<7}): FP8 at zero quantization cost saves {b[scope]['saved_ms']:.1f} ms -> "
            f"{b[scope]['bound_step_ms']:.1f} ms/step, at most {b[scope]['max_speedup']:.3f}x")
    for s in result["steps"]:
        if s["status"] == "ok":
            say(f"measured {s['name']:<20} {s['step_ms_median']:.1f} ms/step  {s['speedup_vs_baseline']:.3f}x")
        else:
            say(f"measured {s['name']:<20} FAILED {error_summary(s['error'])}")
    say(f"wrote {args.out}")
    return 0


def measure(args, timer) -> dict:
    """Record, time the GEMMs with `timer(fn) -> ms`, time the steps; the result is also written to args.out."""
    device = torch.device(args.device)
    spec = model_spec(args)
    custom = dict(parse_custom_variant(s) for s in args.variant)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    variants = resolve_variants(names, json.loads(args.options) if args.options else None, custom)
    if args.step_bf16_ms is None and not variants:
        raise SystemExit("bench_fp8_bound: give --variants (the first is the BF16 baseline) or --step-bf16-ms")
    tokens, _ = load_corpus(None)
    batches = Batches(tokens, args.batch, args.seq, seed=args.seed)
    started = time.perf_counter()
    result = provenance(SCHEMA, device, 1)
    result["config"] = {"model": spec.describe(), "batch": args.batch, "seq": args.seq, "iters": args.iters,
                        "steps": args.steps, "warmup": args.warmup,
                        "fp8": "e4m3, operands pre-quantized, use_fast_accum=True; see the module docstring"}

    say(f"bench_fp8_bound: recording the GEMMs of one eager BF16 step of {spec.describe()}, "
        f"batch {args.batch} x seq {args.seq}")
    model = spec.build(args.seed, device)
    inputs, targets = (t.to(device) for t in batches[0])
    calls, vocab = record_step_gemms(model, inputs, targets)
    del model, inputs, targets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    say(f"{sum(calls.values())} GEMM calls, {len(calls)} distinct; vocabulary {vocab}; timing each")
    rows = gemm_rows(calls, vocab, timer, device)
    result.update(vocab=vocab, gemms=rows)

    steps = []
    if args.step_bf16_ms is None:
        ranks = Ranks(device=device)
        for v in variants:
            say(f"step: {v.name} ({v.backend}, {v.options})")
            steps.append(run_variant(v, spec, batches, steps=args.steps, warmup=args.warmup, lr=args.lr,
                                     seed=args.seed, ranks=ranks, ep=1))
        add_speedups(steps, baseline=names[0] if names else next(iter(custom)))
        if steps[0]["status"] != "ok":
            raise SystemExit(f"bench_fp8_bound: the baseline step {steps[0]['name']!r} failed: {steps[0]['error']}")
        step_bf16 = steps[0]["step_ms_median"]
    else:
        step_bf16 = args.step_bf16_ms
    result.update(step_bf16_ms=step_bf16, steps=steps, bound=bound(rows, step_bf16),
                  seconds=round(time.perf_counter() - started, 1))
    with open(args.out, "w") as f:
        json.dump(json_safe(result), f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
