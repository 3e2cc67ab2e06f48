"""`moepass` command line: demo, inspect, options (and bench / converge where available)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

from moepass.harness import bench, converge, flags
from moepass.harness.corpus import Batches, load_corpus
from moepass.harness.train import train


def _say(msg: str) -> None:
    print(msg, flush=True)


def _build(args, device):
    return flags.model_spec(args).build(args.seed, device)


def _options(args) -> dict:
    return json.loads(args.options) if args.options else {}


# ---------------------------------------------------------------- JSON flags, checked as argparse checks types
# Each returns the flag's text unchanged: bench and converge parse it themselves once it is known good.

_OPTIONS_EXAMPLE = '{"mxfp8.wgrad_bf16": true}'


def _json_object(text: str, example: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({e}); give a JSON object, e.g. {example}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an object; "
                                         f"give a JSON object, e.g. {example}")
    return value


def _valid_options(options: dict) -> None:
    from moepass.options import Config, OptionsError

    try:
        Config.from_options(options)
    except OptionsError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("moepass: ")) from None


def options_json(text: str) -> str:
    """--options: a JSON object of valid backend options."""
    _valid_options(_json_object(text, _OPTIONS_EXAMPLE))
    return text


def model_overrides_json(text: str) -> str:
    """--model-overrides: a JSON object of model config fields."""
    _json_object(text, '{"dim": 512}')
    return text


def variant_json(text: str) -> str:
    """--variant LABEL=JSON: a label and a JSON object of valid backend options."""
    label, sep, own = text.partition("=")
    if not sep or not label.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not LABEL=JSON; give e.g. 'wgrad_bf16={_OPTIONS_EXAMPLE}'")
    _valid_options(_json_object(own, f"'{label.strip()}={_OPTIONS_EXAMPLE}'"))
    return text


JSON_FLAGS = {"--options": options_json, "--model-overrides": model_overrides_json, "--variant": variant_json}


def _check_json_flags(p: argparse.ArgumentParser) -> None:
    """Give the JSON flags of `p` their checks, wherever they were declared (harness/flags.py declares most)."""
    for flag, check in JSON_FLAGS.items():
        action = p._option_string_actions.get(flag)
        if action is not None:
            action.type = check


# ---------------------------------------------------------------- commands


def cmd_options(args) -> int:
    from moepass.options import ENV_VAR, options_table_markdown

    _say(options_table_markdown())
    _say(f"\nWith no options given to torch.compile, the environment variable {ENV_VAR} (a JSON object of these "
         "options) is used; explicit options win and it is then ignored.")
    return 0


def cmd_inspect(args) -> int:
    from moepass.inspect import inspect

    device = torch.device(args.device)
    _say(f"moepass inspect: building {args.flavor} DeepSeek-V3 on {device} ...")
    model = _build(args, device)
    train_tokens, _ = load_corpus()
    inputs, _ = Batches(train_tokens, args.batch, args.seq)[0]
    _say("compiling with backend='moepass' and running one forward ...")
    report = inspect(model, inputs.to(device), options=_options(args))
    _say(report.summary())
    if args.out:
        path = report.save(args.out)
        _say(f"report written: {args.out}/report.json, per-graph code, and {path}")
    return 0


def cpu_speed_note(inductor_s: float, moepass_s: float) -> str:
    """The demo's note under its CPU step table: what this run measured, and why it is not moepass's speed."""
    speed = inductor_s / moepass_s  # the "ratio" of the median line above
    measured = f"moepass ran at {speed:.2f}x Inductor's speed in this run"
    if speed > 1:
        measured += (", although its emulated GEMMs do more work than BF16 ones: a shared or loaded CPU times steps "
                     "unevenly")
    return (f"note: on CPU the MXFP8 GEMMs are emulated (quantize, dequantize, BF16 GEMM): {measured}. The demo "
            "shows the rewrite and the numerics, not the speed-up (that needs sm_100).")


def cmd_demo(args) -> int:
    from moepass.inspect import inspect

    device = torch.device(args.device)
    _say(f"moepass demo: torch {torch.__version__}, device {device}, flavor {args.flavor}")
    if device.type == "cpu" and "TORCHINDUCTOR_VEC_ISA_OK" not in os.environ:
        # The demo shows rewrites and numerics, not CPU speed: Inductor's vectorized C++ codegen (sympy tiling
        # analysis) slows its compiles (docs/install.md has the figure). Export the variable to keep it.
        torch._inductor.config.cpp.vec_isa_ok = False
    _say("[1/4] building the DeepSeek-V3 reference model (BF16) and loading text (stdlib source, bytes) ...")
    base = _build(args, device)
    n_params = sum(p.numel() for p in base.parameters())
    _say(f"      {n_params / 1e6:.1f}M parameters")
    train_tokens, _ = load_corpus()
    batches = Batches(train_tokens, args.batch, args.seq, seed=args.seed)

    _say("[2/4] inspecting: compiling with backend='moepass' (forward graphs, what each pass did) ...")
    report = inspect(copy.deepcopy(base), batches[0][0].to(device), options=_options(args))
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
            _say(cpu_speed_note(med["inductor"], med["moepass"]))
    gap = abs(curves["moepass"][-1].loss - curves["inductor"][-1].loss) / curves["inductor"][-1].loss
    _say(f"final loss: inductor {curves['inductor'][-1].loss:.4f}, moepass {curves['moepass'][-1].loss:.4f} "
         f"(relative gap {gap * 100:.2f}%)")
    return 0


def _add_model_args(p: argparse.ArgumentParser, steps: int | None = None) -> None:
    flags.add_model_flags(p, batch=4, seq=128)
    p.add_argument("--options", default=None, type=options_json,
                   help=f"backend options as JSON, e.g. '{_OPTIONS_EXAMPLE}' (default: none, then $MOEPASS_OPTIONS)")
    p.add_argument("--out", default=None, help="directory for the report (json, code, html)")
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--lr", type=float, default=1e-3)


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser, built without running anything (the docs test checks documented flags with it)."""
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
    for p in sub.choices.values():
        _check_json_flags(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    start = time.perf_counter()
    from moepass.options import Config, OptionsError

    try:
        if args.command != "options":
            Config.from_options(None)  # a bad $MOEPASS_OPTIONS fails here, before any model is built
        rc = args.fn(args)
    except OptionsError as e:  # an options mistake is a usage error: exit 2 with the message, as argparse does
        parser.exit(2, f"moepass {args.command}: error: {str(e).removeprefix('moepass: ')}\n")
    except BrokenPipeError:  # `moepass options | head`: the reader left; exit quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 1
    if args.command != "options":
        _say(f"done in {time.perf_counter() - start:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
