"""Where a MoE layer's time goes, by kind of kernel: the difference of two profiled `moepass bench` depths.

    moepass bench ... --layers 3 --profile --profile-top 3000 --out deep
    moepass bench ... --layers 1 --profile --profile-top 3000 --out shallow
    python examples/profile_shares.py deep/bench.json shallow/bench.json [--out shares.json]

Each variant's kernels (the profiler's device self time over its 2 profiled steps) are put in one kind by name, and
one more MoE layer's time per kind is (deep - shallow) / (layers between them) per step. Kinds, first match wins:
  attention      cuDNN/flash SDPA kernels (forward and backward)
  gemm           tensor-core GEMMs: CUTLASS, cuBLAS (nvjet, sm90_xmma, gemm), FP8 ones included
  quantization   moepass's Triton quantization kernels, and Inductor kernels that only cast to or from FP8
  optimizer      the fused/foreach optimizer kernels
  permute/gather index, gather, scatter, sort, top-k, segment sums: routing tokens to experts and back
  swiglu         Inductor kernels around SiLU (forward and backward), FP8 casts fused into them included
  rest           norms, rope, embedding, loss, elementwise
Inductor fuses quantization into producers, so "quantization" counts only what runs apart; the kernels where a cast
was fused keep the kind of what they fused it into (their names say both: `..._fp8_rowwise_..._silu_...`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

KINDS = (
    ("attention", re.compile(r"sdpa|flash|fmha|attention|compute_dot_do_o|convert_dq", re.I)),
    ("gemm", re.compile(r"cutlass|nvjet|gemm|xmma|sm90_|cublas", re.I)),
    ("quantization", re.compile(r"^_?(quantize|tile_amax|token_group|zero_rows)|_to_mxfp8|to_fp8|fp8_(cast|quant)|"
                                r"^triton_\w*fused_(_to_copy_)?(abs_)?(amax_)?(clamp_)?(_to_copy_)?fp8_rowwise_"
                                r"(quantize_rows|rows_and_cols|expert_weights)_\d+$", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|foreach", re.I)),
    ("swiglu", re.compile(r"silu", re.I)),
    ("permute/gather", re.compile(r"index|gather|scatter|sort|topk|radix|put|segment_sum", re.I)),
)


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "rest")


def _layers(run: dict) -> int:
    return run["config"]["model"]["overrides"]["n_layers"]


def _per_kind(variant: dict) -> dict[str, float]:
    """ms per profiled step of each kind."""
    rows, totals = variant.get("profile") or [], {}
    if not rows:
        raise SystemExit(f"profile_shares: variant {variant['name']!r} has no profile: run `moepass bench` with "
                         "--profile --profile-top 3000")
    for row in rows:
        kind = kind_of(row["name"])
        totals[kind] = totals.get(kind, 0.0) + row["self_us"] / 1000 / 2  # 2 profiled steps
    return totals


def shares(deep: dict, shallow: dict) -> dict:
    layers = _layers(deep) - _layers(shallow)
    if layers <= 0:
        raise SystemExit("profile_shares: the first bench.json must be the deeper run")
    out = {"layers_between": layers, "variants": {}}
    shallow_by_name = {v["name"]: v for v in shallow["variants"]}
    for v in deep["variants"]:
        if v["name"] not in shallow_by_name:
            continue
        a, b = _per_kind(v), _per_kind(shallow_by_name[v["name"]])
        per_layer = {k: round((a.get(k, 0.0) - b.get(k, 0.0)) / layers, 2) for k in dict.fromkeys([*a, *b])}
        total = sum(per_layer.values())
        out["variants"][v["name"]] = {"ms_per_moe_layer": per_layer, "total_ms": round(total, 2),
                                      "share": {k: round(ms / total, 3) for k, ms in per_layer.items()}}
    return out


def table(result: dict) -> str:
    kinds = [k for k, _ in KINDS] + ["rest"]
    names = list(result["variants"])
    lines = ["| kind | " + " | ".join(f"{n} ms (share)" for n in names) + " |", "|---|" + "---|" * len(names)]
    for kind in [*kinds, "total"]:
        cells = []
        for n in names:
            v = result["variants"][n]
            cells.append(f"{v['total_ms']:.1f}" if kind == "total" else
                         f"{v['ms_per_moe_layer'].get(kind, 0.0):.1f} ({v['share'].get(kind, 0.0):.0%})")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("deep")
    p.add_argument("shallow")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = shares(*(json.loads(pathlib.Path(f).read_text()) for f in (args.deep, args.shallow)))
    result["inputs"] = [args.deep, args.shallow]
    print(table(result))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
