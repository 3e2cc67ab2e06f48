"""The backend's options: declared once here, validated into a frozen Config.

`torch.compile(model, backend="moepass", options={...})` passes a flat dict. Keys are either
global (`passes`, `inductor`) or namespaced by the passes that read them (`mxfp8.exclude`).
Every key has a type, a default and a one-line help; the README's options table and
`moepass options` are printed from this table, so they cannot drift.
"""

from __future__ import annotations

import dataclasses
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


PIPELINE = ("deepep", "mxfp8_grouped_mm", "mxfp8_linear")
"""All passes, in the order they run. `options["passes"]` picks a subset; order stays this one."""


@dataclasses.dataclass(frozen=True)
class Option:
    key: str
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    expects: str = ""


def _is_patterns(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v)


def _is_pass_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(p in PIPELINE for p in v)


OPTIONS: tuple[Option, ...] = (
    Option("passes", PIPELINE, "passes to run, by name (they always run in pipeline order)",
           check=_is_pass_list, expects=f"a list drawn from {list(PIPELINE)}"),
    Option("inductor", True, "compile the rewritten graph with Inductor (False: run it eagerly, for debugging)",
           choices=(True, False)),
    Option("report_dir", None, "write the report (json, code, html) here after each compiled graph",
           check=lambda v: v is None or isinstance(v, str), expects="a directory path or None"),
    # auto's Hopper thresholds are measured (fp8_recipe.FP8_ROWWISE_MIN): large linears, and expert GEMMs at
    # thousands of tokens per expert (forward and dgrad; their wgrad stays BF16)
    Option("recipe", "auto", "low-precision recipe of the mxfp8_* passes: auto = mxfp8 on sm_100+ and CPU "
           "(emulated), fp8_rowwise on sm_89/90 where it measured faster than BF16, else BF16; or force "
           "mxfp8 / fp8_rowwise",
           choices=("auto", "mxfp8", "fp8_rowwise")),
    Option("fp8_rowwise.kernel", "auto", "FP8-rowwise kernels: auto picks torch._scaled_mm/_scaled_grouped_mm "
           "on sm_89/90 (grouped: sm_90), emulated elsewhere", choices=("auto", "emulated", "scaled_mm")),
    Option("fp8_rowwise.wgrad_bf16", "auto", "keep the weight-gradient GEMM in BF16 under the fp8_rowwise recipe; "
           "auto = per GEMM kind as measured on Hopper (grouped expert GEMMs BF16, linears FP8)",
           choices=("auto", True, False)),
    Option("mxfp8.scale_rounding", "rceil", "E8M0 scale rounding of the MXFP8 recipe",
           choices=("rceil", "floor")),
    Option("mxfp8.wgrad_bf16", False, "keep the weight-gradient GEMM in BF16 (dgrad and forward stay MXFP8)",
           choices=(True, False)),
    Option("mxfp8.kernel", "auto", "MXFP8 kernels: auto picks native on sm_100, emulated elsewhere",
           choices=("auto", "emulated", "sm100")),
    Option("mxfp8.include", ("*",), "module-path glob patterns to rewrite (fnmatch, e.g. 'layers.*.moe.*')",
           check=_is_patterns, expects="a list of glob strings"),
    Option("mxfp8.exclude", (), "module-path glob patterns never rewritten (wins over include)",
           check=_is_patterns, expects="a list of glob strings"),
    Option("mxfp8.keep_router_bf16", True, "leave the MoE router gate (linear feeding top-k) in BF16",
           choices=(True, False)),
    Option("mxfp8.keep_output_head_bf16", True, "leave the output head (vocabulary projection) in BF16",
           choices=(True, False)),
    Option("deepep.backend", "auto", "EP dispatch/combine implementation: auto picks DeepEP where it runs",
           choices=("auto", "deepep", "reference")),
)

_BY_KEY = {o.key: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated options. Read values with `config["mxfp8.exclude"]`."""

    values: Mapping[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def enabled(self, pass_name: str) -> bool:
        return pass_name in self.values["passes"]

    @property
    def pipeline(self) -> tuple[str, ...]:
        return tuple(p for p in PIPELINE if p in self.values["passes"])

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.values.items()}

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, mode: str | None = None) -> "Config":
        options = dict(options or {})
        unknown = sorted(set(options) - set(_BY_KEY))
        if unknown:
            raise OptionsError(
                f"moepass: unknown option(s) {unknown}. Valid options: {sorted(_BY_KEY)}"
            )
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
            values[opt.key] = tuple(value) if isinstance(value, list) else value
        if mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            raise OptionsError(f"moepass: mode {mode!r} is not a torch.compile mode")
        return cls(values)


def options_table_markdown() -> str:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for o in OPTIONS:
        default = list(o.default) if isinstance(o.default, tuple) else o.default
        values = f" ({' / '.join(map(str, o.choices))})" if o.choices and o.choices != (True, False) else ""
        rows.append(f"| `{o.key}` | `{default!r}` | {o.help}{values} |")
    return "\n".join(rows)
