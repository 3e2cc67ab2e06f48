"""Where a recipe's numerics differ from BF16's: one training step's gradients, per parameter group, per variant.

    python examples/grad_error.py --flavor 16B --layers 2 --batch 2 --seq 512 \
        --model-overrides '{"vocab_size": 4096}' --out examples/results/grad_error_16B_cpu.json

Builds the model once per variant from the same seed, compiles it (BF16 Inductor, or moepass with the variant's
options), runs one forward and backward on the same batch of text, and compares every parameter's gradient with BF16
Inductor's: the signal-to-noise ratio in dB (higher is closer), per group of parameters (attention, dense FFN,
router, shared experts, routed experts, embedding and head). The floor is BF16 itself from weights nudged by an ulp
(converge's --nudged-baseline): a recipe whose gradients sit near the floor perturbs training no more than a
numerically insignificant change; one far below it, in one group, says where its error comes from. The default
variants split MXFP8's error by the causes issue 24 names: scale rounding (rceil against floor), the weight-gradient
path (its wgrad in BF16), and the GEMMs it covers (the routed experts, the linears, attention's alone). On CPU every recipe runs emulated, with
the GPU kernels' quantization.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib

import torch
import torch.nn.functional as F

from moepass import Config, OptionsError
from moepass.harness.converge import nudge_weights
from moepass.harness.corpus import Batches, load_corpus
from moepass.harness.flags import add_model_flags, model_spec
from moepass.harness.model_spec import ModelSpec
from moepass.harness.provenance import provenance
from moepass.harness.variants import parse_custom_variant

BASELINE, NUDGED = "inductor", "inductor-nudged"
# label -> moepass options (None: BF16 Inductor)
VARIANTS = {
    BASELINE: None,
    NUDGED: None,
    "fp8_rowwise": {"recipe": "fp8_rowwise"},
    "blockwise": {"recipe": "blockwise"},
    "mxfp8": {"recipe": "mxfp8"},
    "mxfp8_floor": {"recipe": "mxfp8", "mxfp8.scale_rounding": "floor"},
    "mxfp8_wgrad_bf16": {"recipe": "mxfp8", "mxfp8.wgrad_bf16": True},
    "mxfp8_experts_only": {"recipe": "mxfp8", "lowp.include": ["*.moe.experts"]},
    "mxfp8_linears_only": {"recipe": "mxfp8", "lowp.exclude": ["*.moe.experts"]},
    "mxfp8_attention_only": {"recipe": "mxfp8", "lowp.include": ["*.attention.*"]},
}
# parameter group -> what its name contains (first match wins; the rest is "embedding, norms, head")
GROUPS = (("routed experts", ".moe.experts."), ("shared experts", ".moe.shared_experts."),
          ("router", ".moe.router."), ("dense FFN", ".feed_forward."), ("attention", ".attention."))
OTHER = "embedding, norms, head"


def group_of(name: str) -> str:
    return next((group for group, part in GROUPS if part in name + "."), OTHER)


def gradients(spec: ModelSpec, seed: int, options: dict | None, nudge: bool, batch, device) -> tuple[float, dict]:
    """(loss, {parameter name: fp32 gradient}) of one compiled training step from the seed's initial weights."""
    torch._dynamo.reset()
    model = spec.build(seed, device)
    if nudge:
        nudge_weights(model, seed=seed + 1)
    compiled = torch.compile(model, backend="inductor" if options is None else "moepass",
                             **({} if options is None else {"options": options}))
    inputs, targets = (t.to(device) for t in batch)
    logits = compiled(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def sqnr_db(ref: list[torch.Tensor], out: list[torch.Tensor]) -> float:
    signal = sum(float(r.double().pow(2).sum()) for r in ref)
    noise = sum(float((r.double() - o.double()).pow(2).sum()) for r, o in zip(ref, out))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def compare(base: dict, grads: dict) -> dict:
    """SQNR per group and over every gradient, against the baseline's."""
    missing = sorted(set(base) ^ set(grads))
    if missing:
        raise RuntimeError(f"gradients of different parameters: {missing[:5]}")
    by_group: dict[str, list[str]] = {}
    for name in base:
        by_group.setdefault(group_of(name), []).append(name)
    out = {group: sqnr_db([base[n] for n in names], [grads[n] for n in names]) for group, names in by_group.items()}
    out["all"] = sqnr_db(list(base.values()), [grads[n] for n in base])
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_flags(ap, batch=2, seq=256)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list from {list(VARIANTS)} (the baseline always runs)")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                    help="an extra variant, backend options as JSON (as moepass bench's), e.g. "
                         "'mxfp8_no_ffn={\"recipe\": \"mxfp8\", \"lowp.exclude\": [\"*.feed_forward.*\"]}'")
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    try:  # parsed and their options checked before any compile
        extra = dict(parse_custom_variant(v) for v in args.variant)
        for options in extra.values():
            Config.from_options(options)
    except (ValueError, OptionsError) as e:
        raise SystemExit(str(e))
    variants = {**VARIANTS, **extra}
    names = [BASELINE] + [n for n in args.variants.split(",") if n and n != BASELINE]
    names += [label for label in extra if label not in names]
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise SystemExit(f"grad_error: unknown variants {unknown}; choose from {list(variants)}")
    device = torch.device(args.device)
    spec = model_spec(args)
    train_tokens, _ = load_corpus(limit_bytes=1 << 20)
    batch = Batches(train_tokens, args.batch, args.seq, seed=args.seed)[0]
    result = {**provenance("moepass.grad_error/1", device, 1), "model": spec.describe(), "seed": args.seed,
              "batch": args.batch, "seq": args.seq, "baseline": BASELINE, "variants": {}}
    base_loss, base = gradients(spec, args.seed, None, False, batch, device)
    result["variants"][BASELINE] = {"loss": base_loss}
    print(f"{BASELINE:>20}: loss {base_loss:.5f}", flush=True)
    for name in names[1:]:
        loss, grads = gradients(spec, args.seed, variants[name], name == NUDGED, batch, device)
        sqnr = compare(base, grads)
        result["variants"][name] = {"options": variants[name], "loss": loss,
                                    "loss_rel_diff": (loss - base_loss) / base_loss, "grad_sqnr_db": sqnr}
        print(f"{name:>20}: loss {loss:.5f} ({(loss - base_loss) / base_loss * 100:+.3f}%), gradient SQNR vs BF16: "
              + ", ".join(f"{g} {db:.1f} dB" for g, db in sqnr.items()), flush=True)
        if args.out:  # after every variant: a run cut short keeps what it measured
            pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
