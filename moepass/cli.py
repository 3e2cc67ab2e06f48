"""`moepass` command line: demo, inspect, options (and bench / converge where available)."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time

import torch

from moepass import bench, converge


def _say(msg: str) -> None:
    print(msg, flush=True)


def _build(args, device):
    return bench.model_spec(args).build(args.seed, device)


def _options(args) -> dict:
    return json.loads(args.options) if args.options else {}


def cmd_options(args) -> int:
    from moepass.options import options_table_markdown

    _say(options_table_markdown())
    return 0


def cmd_inspect(args) -> int:
    import moepass
    from moepass.data import Batches, load_corpus

    device = torch.device(args.device)
    _say(f"moepass inspect: building {args.flavor} DeepSeek-V3 on {device} ...")
    model = _build(args, device)
    train_tokens, _ = load_corpus()
    inputs, _ = Batches(train_tokens, args.batch, args.seq)[0]
    _say("compiling with backend='moepass' and running one forward ...")
    report = moepass.inspect(model, inputs.to(device), options=_options(args))
    _say(report.summary())
    if args.out:
        path = report.save(args.out)
        _say(f"report written: {args.out}/report.json, per-graph code, and {path}")
    return 0


def cmd_demo(args) -> int:
    import moepass
    from moepass.data import Batches, load_corpus
    from moepass.train import train

    device = torch.device(args.device)
    _say(f"moepass demo: torch {torch.__version__}, device {device}, flavor {args.flavor}")
    _say("[1/4] building the DeepSeek-V3 reference model (BF16) and loading text (stdlib source, bytes) ...")
    base = _build(args, device)
    n_params = sum(p.numel() for p in base.parameters())
    _say(f"      {n_params / 1e6:.1f}M parameters")
    train_tokens, _ = load_corpus()
    batches = Batches(train_tokens, args.batch, args.seq, seed=args.seed)

    _say("[2/4] inspecting: compiling with backend='moepass' (forward graphs, what each pass did) ...")
    report = moepass.inspect(copy.deepcopy(base), batches[0][0].to(device), options=_options(args))
    _say(report.summary())
    if args.out:
        _say(f"      full report: {report.save(args.out)}")

    curves = {}
    for i, (name, backend, kwargs) in enumerate(
            [("inductor", "inductor", {}), ("moepass", "moepass", {"options": _options(args)})], start=3):
        _say(f"[{i}/4] training {args.steps} steps with backend={backend!r} (step 0 includes compilation) ...")
        model = copy.deepcopy(base)
        compiled = torch.compile(model, backend=backend, **kwargs)
        curves[name] = train(model, compiled, batches, args.steps, device, lr=args.lr,
                             on_step=lambda r: _say(f"      step {r.step:>3}  loss {r.loss:.4f}  {r.seconds * 1e3:9.1f} ms"))

    _say("\nstep   inductor loss   moepass loss   inductor ms   moepass ms")
    for a, b in zip(curves["inductor"], curves["moepass"]):
        _say(f"{a.step:>4}   {a.loss:>13.4f}   {b.loss:>12.4f}   {a.seconds * 1e3:>11.1f}   {b.seconds * 1e3:>10.1f}")
    if args.steps > 2:
        med = {k: statistics.median(r.seconds for r in v[1:]) for k, v in curves.items()}
        _say(f"\nmedian step time after step 0: inductor {med['inductor'] * 1e3:.1f} ms, "
             f"moepass {med['moepass'] * 1e3:.1f} ms (ratio {med['inductor'] / med['moepass']:.2f}x)")
        if device.type == "cpu":
            _say("note: on CPU the MXFP8 GEMMs are emulated (quantize, dequantize, BF16 GEMM), so moepass is "
                 "slower here; the demo shows the rewrite and the numerics, not the speed-up (that needs sm_100).")
    gap = abs(curves["moepass"][-1].loss - curves["inductor"][-1].loss) / curves["inductor"][-1].loss
    _say(f"final loss: inductor {curves['inductor'][-1].loss:.4f}, moepass {curves['moepass'][-1].loss:.4f} "
         f"(relative gap {gap * 100:.2f}%)")
    return 0


def _add_model_args(p: argparse.ArgumentParser, steps: int | None = None) -> None:
    bench.add_model_flags(p, batch=4, seq=128)
    p.add_argument("--options", default=None, help='backend options as JSON, e.g. \'{"mxfp8.wgrad_bf16": true}\'')
    p.add_argument("--out", default=None, help="directory for the report (json, code, html)")
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--lr", type=float, default=1e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moepass", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job: debug DeepSeek-V3, per-pass table, BF16 vs moepass training")
    _add_model_args(p, steps=8)
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("inspect", help="compile once with moepass and print/save what each pass did")
    _add_model_args(p)
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("options", help="print the backend's options table")
    p.set_defaults(fn=cmd_options)
    p = sub.add_parser("bench", help="tokens/s, step time, memory and compile time per variant, side by side")
    bench.add_arguments(p)
    p.set_defaults(fn=bench.cmd_bench)
    p = sub.add_parser("converge", help="BF16 vs moepass loss curves from the same seed and data; PASS/FAIL")
    converge.add_arguments(p)
    p.set_defaults(fn=converge.cmd_converge)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # torchao's CUDA extensions cannot load here; the report says what runs
        logging.getLogger("torchao").setLevel(logging.ERROR)
    start = time.perf_counter()
    rc = args.fn(args)
    if args.command != "options":
        _say(f"done in {time.perf_counter() - start:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
