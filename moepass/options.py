"""The backend's options: declared once here, validated into a frozen Config.

`torch.compile(model, backend="moepass", options={...})` passes a flat dict. Keys are either
global (`passes`, `inductor`) or namespaced by the part that reads them (`lowp.exclude`: both
low-precision GEMM passes; `mxfp8.scale_rounding`: one recipe; `inductor.mode`). Every key has a type,
a default and a one-line help; the README's options table and `moepass options` are printed from this
table, so they cannot drift.

Renamed passes and keys keep their old names as aliases (PASS_ALIASES, Option.aliases): an old name means
exactly the new one, and the Config holds only the new names.

When torch.compile passes no options (none, or an empty dict: torch drops those), the environment
variable MOEPASS_OPTIONS, a JSON object of the same keys, is used instead: for stacks that compile with
`backend="moepass"` and offer no way to pass options. Explicit options win: when any are given,
MOEPASS_OPTIONS is ignored, whatever it holds.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import reprlib
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

try:  # Dynamo wraps backend errors in BackendCompilerFailed unless they are ShortenTraceback.
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover - older torch: the ValueError arrives wrapped
    _PassThrough = Exception


class OptionsError(ValueError, _PassThrough):
    """A bad `options` key or value. Reaches the caller of torch.compile as a ValueError."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.first_useful_frame = None  # read by Dynamo's ShortenTraceback handling


log = logging.getLogger(__name__)

ENV_VAR = "MOEPASS_OPTIONS"
_ENV_EXAMPLE = '{"passes": ["linear"]}'

PIPELINE = ("deepep", "weights_before_gemm", "grouped_mm", "quantize_once", "linear")
"""All passes, in the order they run. `options["passes"]` picks a subset; order stays this one."""

DEFAULT_PASSES = PIPELINE
"""The passes run by default: all of them. quantize_once joined after its H200 A/B at 671B dims, 5 layers (the same
step time, 6.2 GiB less at the peak; numerics over seeds within the nudged spread: examples/results/README.md)."""

PASS_NEEDS = {"quantize_once": ("grouped_mm",)}
"""Passes that rewrite another pass's ops, and that pass: a benchmark variant of one runs both."""

PASS_ALIASES = {"mxfp8_grouped_mm": "grouped_mm", "mxfp8_linear": "linear"}
"""Old pass names (from before the FP8-rowwise recipe) -> the pass they name."""


def canonical_pass(name: str) -> str:
    """A pass name or alias -> the pass's name (anything else unchanged, for the caller to reject)."""
    return PASS_ALIASES.get(name, name)


@dataclasses.dataclass(frozen=True)
class Option:
    key: str
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    expects: str = ""
    aliases: tuple[str, ...] = ()  # old keys that mean this one


def _is_patterns(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v)


def _is_pass_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(p, str) and canonical_pass(p) in PIPELINE for p in v)


def _is_dir_path(v: Any) -> bool:
    return v is None or (isinstance(v, (str, os.PathLike)) and os.fspath(v) != "")


INDUCTOR_MODES = ("default", "lite", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
"""torch.compile's modes: `torch._inductor.list_mode_options()` on torch 2.11 and 2.13 (a test checks it)."""

MOEPASS_INDUCTOR_PATCHES = ("post_grad_custom_post_pass", "joint_custom_pre_pass")
"""Inductor config entries backend.py sets itself (compiled-graph audit, EP exchanges saved for backward)."""


OPTIONS: tuple[Option, ...] = (
    Option("passes", DEFAULT_PASSES, "passes to run, by name (they always run in pipeline order: "
           f"{', '.join(PIPELINE)}); old names "
           + ", ".join(f"{old} = {new}" for old, new in PASS_ALIASES.items()),
           check=_is_pass_list, expects=f"a list drawn from {list(PIPELINE)} (or old names {list(PASS_ALIASES)})"),
    Option("inductor", True, "compile the rewritten graph with Inductor (False: run it eagerly, for debugging)",
           choices=(True, False)),
    Option("inductor.mode", None, "Inductor mode, as torch.compile's mode= takes it; set it here to use a mode "
           "together with options (torch.compile refuses both); None: torch.compile's mode=, if any",
           choices=(None, *INDUCTOR_MODES)),
    Option("inductor.options", {}, "Inductor config patches {name: value}, names from torch._inductor.config "
           "(e.g. 'max_autotune', 'triton.cudagraphs'); applied after inductor.mode's",
           check=lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
           expects="a dict of torch._inductor.config names to values, e.g. {'max_autotune': True}"),
    Option("report_dir", None, "write the run's report here (json, code, html; an index with totals per pass and a "
           "report per graph), updated as each graph compiles; under torch.distributed each rank in rank<r>/",
           check=_is_dir_path, expects="a directory path or None"),
    # the recipes: moepass.recipes (one object each); auto on Hopper reads a measured table (recipes/auto_table: per
    # GEMM and token count), and a size rule (recipes.auto.FP8_ROWWISE_MIN) for shapes it does not hold
    Option("recipe", "auto", "low-precision recipe of the grouped_mm and linear passes: auto = mxfp8 on "
           "sm_100+ and CPU (emulated), fp8_rowwise on sm_89/90 where it measured faster than BF16, else BF16; "
           "or force mxfp8 / fp8_rowwise / blockwise (DeepSeek-V3's 1x128 / 128x128 FP8; opt-in, auto never picks it)",
           choices=("auto", "mxfp8", "fp8_rowwise", "blockwise")),
    Option("fp8_rowwise.kernel", "auto", "FP8-rowwise kernels: auto picks torch._scaled_mm/_scaled_grouped_mm "
           "on sm_89/90 (grouped: sm_90), emulated elsewhere", choices=("auto", "emulated", "scaled_mm")),
    Option("fp8_rowwise.wgrad_bf16", "auto", "keep the weight-gradient GEMM in BF16 under the fp8_rowwise recipe; "
           "auto = per GEMM kind as measured on Hopper (FP8 for linears and, since quantize_once, grouped "
           "expert GEMMs)",
           choices=("auto", True, False)),
    # The three below take the FP8-rowwise quantizations out of Inductor's graph (one op writes both layouts an
    # operand's two GEMMs read): cold compile at 671B dims, 5 layers, one H200 from 3.3x Inductor's to 1.33x, the
    # step 1.14x Inductor's as before (examples/results/README.md, compile time). "auto" turns the weights' ones
    # off under FSDP2: the saved FP8 copy of each gathered weight would outlive FSDP's reshard until the backward.
    Option("fp8_rowwise.expert_weights_once", "auto", "quantize each expert weight once per step into both FP8 "
           "layouts (one Triton pass; the dgrad's is saved for the backward: 1 byte per expert weight element); "
           "auto = on unless the weights are sharded by FSDP2 (fully_shard), whose reshard the saved copy would undo",
           choices=("auto", True, False)),
    Option("fp8_rowwise.linear_both_layouts", "auto", "quantize a linear's gradient (grads) and input (inputs) "
           "once into both FP8 layouts its two GEMMs read (per token and per channel; two reads by moepass's Triton "
           "kernels, the input's per-channel half saved for the wgrad in FP8) instead of twice, each fused into "
           "its producer by Inductor; needs the FP8 wgrad; auto = grads_and_inputs when the linears' wgrad is FP8",
           choices=("auto", "none", "grads", "grads_and_inputs")),
    Option("fp8_rowwise.linear_weights_once", "auto", "quantize each linear weight once per step into both FP8 "
           "layouts its forward and dgrad read (moepass's Triton kernels, two reads; the dgrad's half saved for the "
           "backward: 1 byte per weight element) instead of twice by Inductor; auto = on unless the weights are "
           "sharded by FSDP2", choices=("auto", True, False)),
    Option("mxfp8.scale_rounding", "rceil", "E8M0 scale rounding of the MXFP8 recipe",
           choices=("rceil", "floor")),
    Option("mxfp8.wgrad_bf16", False, "keep the weight-gradient GEMM in BF16 (dgrad and forward stay MXFP8)",
           choices=(True, False)),
    Option("mxfp8.kernel", "auto", "MXFP8 kernels: auto picks native on sm_100, emulated elsewhere",
           choices=("auto", "emulated", "sm100")),
    Option("blockwise.kernel", "auto", "blockwise FP8 kernels: auto = on sm_90 torch._scaled_mm for linears and, "
           "one per token group, for grouped GEMMs (measured faster than the Triton kernels); where it does not run, "
           "moepass's Triton grouped kernels (one launch per GEMM; self-checked once); emulated on CPU; other GPUs "
           "keep BF16. emulated: the reference numerics anywhere; triton: grouped GEMMs on those kernels (linears on "
           "scaled_mm); deepgemm: grouped GEMMs on DeepGEMM through torchao's blockwise grouped op, on request only "
           "(when deep_gemm is installed and passes a one-time self-check; measured mostly slower than BF16 op by op, "
           "and failing in a 671B-dims step); scaled_mm: grouped GEMMs one torch._scaled_mm per token group",
           choices=("auto", "emulated", "scaled_mm", "triton", "deepgemm")),
    Option("blockwise.wgrad_bf16", False, "keep the weight-gradient GEMM in BF16 under the blockwise recipe (forward "
           "and dgrad stay FP8)", choices=(True, False)),
    Option("quantize_once.saved_rows", "auto", "what the quantize_once pass keeps of the experts' input rows for "
           "the weight gradient: fp8 = the FP8 rows and their scales (half the bytes of BF16 rows; the wgrad reads "
           "them dequantized, so a BF16 wgrad sees the quantized rows, and blockwise's FP8 wgrad runs in BF16 on "
           "them); bf16 = the BF16 rows, as without the pass (the wgrad then bit-equal to grouped_mm's); auto = fp8 "
           "unless that would turn the recipe's FP8 wgrad into BF16 (blockwise)", choices=("auto", "fp8", "bf16")),
    Option("lowp.include", ("*",), "module-path glob patterns the low-precision GEMM passes rewrite (fnmatch, "
           "e.g. 'layers.*.moe.*')", check=_is_patterns, expects="a list of glob strings", aliases=("mxfp8.include",)),
    Option("lowp.exclude", (), "module-path glob patterns never rewritten (wins over include)",
           check=_is_patterns, expects="a list of glob strings", aliases=("mxfp8.exclude",)),
    Option("lowp.keep_router_bf16", True, "leave the MoE router gate (linear feeding top-k) in BF16",
           choices=(True, False), aliases=("mxfp8.keep_router_bf16",)),
    Option("lowp.keep_output_head_bf16", True, "leave the output head (vocabulary projection) in BF16",
           choices=(True, False), aliases=("mxfp8.keep_output_head_bf16",)),
    Option("lowp.take_over_torchao", False, "rewrite GEMMs whose weight torchao converted to a tensor subclass "
           "(quantize_ with a MoE-training config) with moepass's recipe instead of leaving them to torchao; the "
           "report says which torchao config it overrode. Opaque torchao calls (Float8Linear, MXFP8Linear) stay "
           "torchao's", choices=(True, False)),
    Option("deepep.backend", "auto", "EP dispatch/combine implementation: auto picks DeepEP where it runs",
           choices=("auto", "deepep", "reference")),
)

_BY_KEY = {o.key: o for o in OPTIONS}
OPTION_ALIASES = {alias: o.key for o in OPTIONS for alias in o.aliases}
"""Old option keys -> the key they name."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated options. Read values with `config["lowp.exclude"]` (an old key reads its new one)."""

    values: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[OPTION_ALIASES.get(key, key)]

    def enabled(self, pass_name: str) -> bool:
        return canonical_pass(pass_name) in self.values["passes"]

    @property
    def pipeline(self) -> tuple[str, ...]:
        return tuple(p for p in PIPELINE if p in self.values["passes"])

    def with_values(self, **values: Any) -> "Config":
        """This config with some values settled (recipes resolving their "auto" options for one graph)."""
        return dataclasses.replace(self, values={**self.values, **values})

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v
                for k, v in self.values.items()}

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> "Config":
        """Validate `options` (falling back to MOEPASS_OPTIONS when none are given) and torch.compile's `mode`."""
        env = os.environ.get(ENV_VAR)
        given = not (options is None or (isinstance(options, Mapping) and not options))
        if given or env is None:
            if env is not None:
                log.info("moepass: explicit options given; %s ignored", ENV_VAR)
            return cls._validated(options, mode)
        from_env = options_from_env(env)
        try:
            return cls._validated(from_env, mode)
        except OptionsError as e:
            raise OptionsError(f"{e} (options read from the {ENV_VAR} environment variable)") from None

    @classmethod
    def _validated(cls, options: Any, mode: str | None) -> "Config":
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise OptionsError(f"moepass: options must be a dict of option names to values, not "
                               f"{type(options).__name__} {reprlib.repr(options)}. Valid options: {sorted(_BY_KEY)}")
        unknown = sorted(set(options) - set(_BY_KEY) - set(OPTION_ALIASES), key=str)
        if unknown:
            near = [m for u in unknown if isinstance(u, str) for m in difflib.get_close_matches(u, _BY_KEY, n=1)]
            raise OptionsError(
                f"moepass: unknown option(s) {unknown}{f' (did you mean {near}?)' if near else ''}. "
                f"Valid options: {sorted(_BY_KEY)}"
            )
        options = _new_keys(options)
        values = {}
        for opt in OPTIONS:
            value = options.get(opt.key, opt.default)
            if opt.choices is not None and not any(value is c or value == c for c in opt.choices
                                                   if type(value) is type(c)):
                raise OptionsError(
                    f"moepass: option {opt.key!r}={value!r} is not valid; valid values: {list(opt.choices)}"
                )
            if opt.check is not None and not opt.check(value):
                raise OptionsError(f"moepass: option {opt.key!r}={value!r} is not valid; expected {opt.expects}")
            values[opt.key] = _frozen(value)
        values["passes"] = tuple(dict.fromkeys(canonical_pass(p) for p in values["passes"]))
        values["inductor.mode"] = _effective_mode(values["inductor.mode"], mode)
        _check_inductor_patches(values["inductor.options"])
        if values["fp8_rowwise.linear_both_layouts"] not in ("none", "auto") and values["fp8_rowwise.wgrad_bf16"] is True:
            raise OptionsError("moepass: option 'fp8_rowwise.linear_both_layouts'="
                               f"{values['fp8_rowwise.linear_both_layouts']!r} quantizes for the FP8 wgrad, which "
                               "'fp8_rowwise.wgrad_bf16'=True turns off; set one of them back to its default")
        if values["report_dir"] is not None:
            _check_report_dir(values["report_dir"])
        return cls(values)


def _new_keys(options: Mapping[str, Any]) -> dict[str, Any]:
    """Old keys renamed to their new ones; an old and a new key for the same option together are an error."""
    renamed = {}
    for key, value in options.items():
        new = OPTION_ALIASES.get(key, key)
        if new in renamed:
            given = sorted(k for k in options if OPTION_ALIASES.get(k, k) == new)
            raise OptionsError(f"moepass: options {given} name the same option ({new!r} is the new name "
                               "of the others); give it once")
        renamed[new] = value
    return renamed


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return dict(value) if isinstance(value, Mapping) else value


def options_from_env(text: str) -> dict:
    """MOEPASS_OPTIONS' text -> an options dict (validated by Config.from_options)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionsError(f"moepass: environment variable {ENV_VAR}={text!r} is not valid JSON ({e}); set it to "
                           f"a JSON object of option names to values, e.g. '{_ENV_EXAMPLE}', or unset it") from None
    if not isinstance(value, dict):
        raise OptionsError(f"moepass: environment variable {ENV_VAR}={text!r} is a JSON {type(value).__name__}, not "
                           f"an object; set it to a JSON object of option names to values, e.g. '{_ENV_EXAMPLE}'. "
                           f"Valid options: {sorted(_BY_KEY)}")
    log.info("moepass: options from %s: %s", ENV_VAR, value)
    return value


def _effective_mode(option: str | None, mode: str | None) -> str | None:
    """The `inductor.mode` option, else torch.compile's mode=; both given must agree."""
    if mode is not None and mode not in INDUCTOR_MODES:
        raise OptionsError(f"moepass: torch.compile mode={mode!r} is not valid; valid modes: {list(INDUCTOR_MODES)}")
    if option is not None and mode is not None and option != mode:
        raise OptionsError(f"moepass: torch.compile mode={mode!r} and option 'inductor.mode'={option!r} disagree; "
                           "give the mode once (with options, as 'inductor.mode')")
    return option if option is not None else mode


def _check_inductor_patches(patches: Mapping[str, Any]) -> None:
    if not patches:
        return
    import torch._inductor.config as inductor_config  # only here: importing Inductor costs a second

    known = inductor_config.get_config_copy()
    for key in patches:
        if key in MOEPASS_INDUCTOR_PATCHES:
            raise OptionsError(f"moepass: option 'inductor.options' sets {key!r}, which moepass sets itself "
                               f"({list(MOEPASS_INDUCTOR_PATCHES)} are moepass's); leave it out")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=3)
            raise OptionsError(f"moepass: option 'inductor.options' key {key!r} is not an Inductor config"
                               f"{f' (did you mean {near}?)' if near else ''}; valid keys are the names in "
                               "torch._inductor.config (torch/_inductor/config.py; dotted for sub-configs, "
                               "e.g. 'triton.cudagraphs')")


def _check_report_dir(path: str) -> None:
    """Create the directory and write a file there now, not after every pass has run."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".moepass-probe-") as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as e:
        raise OptionsError(f"moepass: option 'report_dir'={path!r} is not a writable directory ({e}); "
                           "give a directory moepass can create and write to, or None") from None


def options_table_markdown() -> str:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for o in OPTIONS:
        default = list(o.default) if isinstance(o.default, tuple) else o.default
        values = f" ({' / '.join(map(str, o.choices))})" if o.choices and o.choices != (True, False) else ""
        was = f" (old name {', '.join(f'`{a}`' for a in o.aliases)})" if o.aliases else ""
        rows.append(f"| `{o.key}`{was} | `{default!r}` | {o.help}{values} |")
    return "\n".join(rows)
