"""Bytes a training step keeps for its backward, per variant, measured side by side on the same model and batch.

    python examples/saved_activations.py --flavor 16B --layers 2 --batch 1 --seq 512 \
        --options '{"recipe": "fp8_rowwise"}' --out examples/results/saved_activations_16B_cpu.json
    # what a bench step keeps, the loss compiled in, by tensor shape, on a GPU:
    python examples/saved_activations.py --device cuda --flavor 671B --layers 2 \
        --model-overrides '{"n_dense_layers": 1, "n_routed_experts": 32}' --batch 4 --seq 4096 \
        --with-loss --variants inductor,moepass --by-shape 25

Compiles the model once per variant (BF16 Inductor; moepass with its default passes; moepass without
weights_before_gemm, whose backward keeps the experts' unweighted output) and runs one training forward under torch.autograd.graph.saved_tensors_hooks,
summing the distinct storages the compiled forward saves for the backward (parameters excluded: every variant keeps
them). This is the activation memory the backward holds, not a device's peak (allocator, workspaces, the optimizer):
it runs on CPU too, where the FP8 recipes run emulated with the GPU kernels' quantization.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from moepass.harness.model_spec import ModelSpec
from moepass.harness.provenance import provenance
from moepass.harness.train import with_loss

VARIANTS = {"inductor": None, "moepass": {}, "moepass-weights_before_gemm": {
    "passes": ["deepep", "grouped_mm", "quantize_once", "linear"]}}


def saved_bytes(model: torch.nn.Module, *inputs: torch.Tensor, forward=None) -> dict:
    """{total, by dtype, by shape} bytes of the distinct non-parameter storages one forward saves for the backward.

    forward: what to call on `inputs` (default: the model); its parameters are still those of `model`.
    by_shape: [{shape, dtype, count, bytes}], largest first: a storage under the shape of the first view saved.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, tuple[int, str, tuple]] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages.setdefault(storage.data_ptr(), (storage.nbytes(), str(t.dtype).removeprefix("torch."),
                                                     tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # the forward saves what its backward will read; no backward needs to run
        out = (model if forward is None else forward)(*inputs)
    del out
    by_dtype: dict[str, int] = {}
    by_shape: dict[tuple, list[int]] = {}
    for nbytes, dtype, shape in storages.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + nbytes
        count_bytes = by_shape.setdefault((shape, dtype), [0, 0])
        count_bytes[0] += 1
        count_bytes[1] += nbytes
    shapes = [{"shape": list(shape), "dtype": dtype, "count": n, "bytes": b}
              for (shape, dtype), (n, b) in sorted(by_shape.items(), key=lambda kv: -kv[1][1])]
    return {"total": sum(by_dtype.values()), "by_dtype": dict(sorted(by_dtype.items())), "by_shape": shapes}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--model-overrides", default="{}", help="JSON dict of config overrides")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--options", default="{}", help="backend options for every moepass variant, as JSON")
    ap.add_argument("--with-loss", action="store_true",
                    help="compile the next-token loss with the model, as `moepass bench` does (the logits it keeps)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {list(VARIANTS)}")
    ap.add_argument("--by-shape", type=int, default=0, metavar="N", help="print the N largest shapes kept")
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    overrides = json.loads(args.model_overrides)
    if args.layers:
        overrides["n_layers"] = args.layers
    spec = ModelSpec(args.flavor, overrides)
    names = [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or "inductor" not in names:
        raise SystemExit(f"saved_activations: --variants {args.variants!r}: choose from {list(VARIANTS)}, "
                         "inductor among them (the ratios' baseline)")
    tokens = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    targets = torch.roll(tokens, -1, dims=1)
    result = {**provenance("moepass.saved_activations/1", device, 1), "flavor": args.flavor,
              "overrides": overrides, "batch": args.batch, "seq": args.seq, "with_loss": args.with_loss,
              "variants": {}}
    for name in names:
        own = VARIANTS[name]
        torch._dynamo.reset()
        model = spec.build(0, device)
        options = None if own is None else {**json.loads(args.options), **own}
        compiled = torch.compile(with_loss(model) if args.with_loss else model,
                                 backend="inductor" if own is None else "moepass",
                                 **({} if options is None else {"options": options}))
        inputs = (tokens, targets) if args.with_loss else (tokens,)
        result["variants"][name] = measured = saved_bytes(model, *inputs, forward=compiled)
        print(f"{name:>24}: {measured['total'] / 2**20:9.1f} MiB saved for the backward  {measured['by_dtype']}",
              flush=True)
        for row in measured["by_shape"][:args.by_shape]:
            print(f"    {row['bytes'] / 2**20:10.1f} MiB  {row['count']:>3} x {row['dtype']:<14} {row['shape']}")
        del model, compiled
    base = result["variants"]["inductor"]["total"]
    for name, measured in result["variants"].items():
        measured["vs_inductor"] = round(measured["total"] / base, 4)
    print("  vs inductor: " + ", ".join(f"{n} {m['vs_inductor']:.3f}x" for n, m in result["variants"].items()))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
