"""The backend's options: declared as typed sections, validated into a frozen Config.

`torch.compile(model, backend="moepass", options={...})` passes a flat dict. Keys are either
global (`passes`, `inductor`) or namespaced by the part that reads them (`lowp.exclude`: both
low-precision GEMM passes; `mxfp8.scale_rounding`: one recipe; `inductor.mode`). Each part declares its keys as
a frozen dataclass (option_types: the field's type lists its values, `option()` its default and one-line help):
the sections here, and each registered recipe's Options (moepass.recipes.registry). The README's options table and
`moepass options` are printed from the table they make, so they cannot drift.

Renamed passes and keys keep their old names (PASS_ALIASES, Option.aliases): an old name means exactly the new one,
with a DeprecationWarning naming the new one; the Config holds only the new names, and the table lists only those.

When torch.compile passes no options (none, or an empty dict: torch drops those), the environment
variable MOEPASS_OPTIONS, a JSON object of the same keys, is used instead: for stacks that compile with
`backend="moepass"` and offer no way to pass options. Explicit options win: when any are given,
MOEPASS_OPTIONS is ignored, whatever it holds.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import reprlib
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from .option_types import Option, OptionsError, option, read, section_options

log = logging.getLogger(__name__)

ENV_VAR = "MOEPASS_OPTIONS"
_ENV_EXAMPLE = '{"passes": ["linear"]}'

PIPELINE = ("deepep", "weights_before_gemm", "grouped_mm", "quantize_once", "linear")
"""All passes, in the order they run. `options["passes"]` picks a subset; order stays this one."""

DEFAULT_PASSES = PIPELINE
"""The passes run by default: all of them."""

PASS_NEEDS = {"quantize_once": ("grouped_mm",)}
"""Passes that rewrite another pass's ops, and that pass: a benchmark variant of one runs both."""

PASS_ALIASES = {"mxfp8_grouped_mm": "grouped_mm", "mxfp8_linear": "linear"}
"""Old pass names (from before the FP8-rowwise recipe) -> the pass they name."""


def canonical_pass(name: str) -> str:
    """A pass name or alias -> the pass's name (anything else unchanged, for the caller to reject)."""
    return PASS_ALIASES.get(name, name)


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


InductorMode = Literal[(None, *INDUCTOR_MODES)]


@dataclasses.dataclass(frozen=True)
class Core:
    """The options without a prefix."""

    passes: tuple[str, ...] = option(
        DEFAULT_PASSES, f"passes to run, by name; they run in pipeline order ({', '.join(PIPELINE)})",
        check=_is_pass_list, expects=f"a list drawn from {list(PIPELINE)} (or old names {list(PASS_ALIASES)})")
    inductor: bool = option(True, "compile the rewritten graph with Inductor (False: run it eagerly, for debugging)")
    report_dir: str | None = option(
        None, "write the run's report here (json, code, html) as each graph compiles; each rank in rank<r>/",
        check=_is_dir_path, expects="a directory path or None")
    # its choices are "auto" and the registered recipes' names (options_table)
    recipe: str = option("auto", "low-precision recipe of the linear and grouped_mm passes; auto picks per GEMM and "
                         "device")


@dataclasses.dataclass(frozen=True)
class Inductor:
    mode: InductorMode = option(
        None, "Inductor mode as torch.compile's mode= takes it, to give with options (None: torch.compile's mode=)")
    options: Mapping[str, Any] = option(
        {}, "Inductor config patches {name: value} from torch._inductor.config, applied after inductor.mode's",
        check=lambda v: isinstance(v, Mapping) and all(isinstance(k, str) for k in v),
        expects="a dict of torch._inductor.config names to values, e.g. {'max_autotune': True}")


@dataclasses.dataclass(frozen=True)
class Lowp:
    """What both low-precision GEMM passes (linear, grouped_mm) rewrite."""

    include: tuple[str, ...] = option(
        ("*",), "module-path glob patterns the low-precision GEMM passes rewrite (fnmatch, e.g. 'layers.*.moe.*')",
        check=_is_patterns, expects="a list of glob strings", aliases=("mxfp8.include",))
    exclude: tuple[str, ...] = option(
        (), "module-path glob patterns never rewritten (wins over include)", check=_is_patterns,
        expects="a list of glob strings", aliases=("mxfp8.exclude",))
    keep_router_bf16: bool = option(True, "leave the MoE router gate (linear feeding top-k) in BF16",
                                    aliases=("mxfp8.keep_router_bf16",))
    keep_output_head_bf16: bool = option(True, "leave the output head (vocabulary projection) in BF16",
                                         aliases=("mxfp8.keep_output_head_bf16",))
    take_over_torchao: bool = option(
        False, "rewrite GEMMs whose weights torchao converted (quantize_) with moepass's recipe instead of torchao's")


@dataclasses.dataclass(frozen=True)
class Auto:
    """How recipe="auto" decides a GEMM its GPU's shipped table does not hold."""

    measure: bool = option(True, "time FP8 against BF16 on this GPU for GEMMs its shipped table lacks (cached on "
                                 "disk); False: the size rule")


@dataclasses.dataclass(frozen=True)
class QuantizeOnce:
    saved_rows: Literal["auto", "fp8", "bf16"] = option(
        "auto", "rows quantize_once keeps for the experts' wgrad; auto: fp8 unless that turns an FP8 wgrad into BF16")
    swiglu_inputs: Literal["bf16", "fp8"] = option(
        "bf16", "what the SwiGLU before an expert GEMM keeps for its backward; fp8: gate and up in e4m3 (1x128 "
                "tiles), written with w2's FP8 rows by one fused op")


@dataclasses.dataclass(frozen=True)
class DeepEP:
    backend: Literal["auto", "deepep", "reference"] = option(
        "auto", "EP dispatch/combine implementation: auto picks DeepEP where it runs")


@dataclasses.dataclass(frozen=True)
class SegmentSums:
    """Inside Inductor: scatter-adds of rows into zeros (an MoE's combine, a gather's backward) as sorted segment sums."""

    devices: Literal["cuda", "all", "none"] = option(
        "cuda", "where the rewrite runs; cuda: CUDA graphs (a Triton kernel), all: also elsewhere (torch's "
                "index_add, for tests), none: never (Inductor's atomic adds)")
    permutations: Literal["kernel", "gather"] = option(
        "kernel", "sums along a routing permutation (index = sort indices // top_k); gather: a gather-sum Inductor "
                  "fuses with the rows' producers, on any device; kernel: as the other sums")


SECTIONS: dict[str, type] = {"": Core, "inductor": Inductor, "lowp": Lowp, "auto": Auto,
                             "quantize_once": QuantizeOnce, "deepep": DeepEP, "segment_sums": SegmentSums}
"""moepass's own option sections by prefix; each registered recipe adds its Options under its name."""


def options_table() -> tuple[Option, ...]:
    """Every option, as `moepass options` lists them: moepass's own sections, then each registered recipe's."""
    from moepass.recipes.registry import RECIPES

    return _table(tuple(RECIPES.values()))


@functools.lru_cache(maxsize=8)
def _table(recipes: tuple) -> tuple[Option, ...]:
    own = [o for prefix, section in SECTIONS.items() for o in section_options(section, prefix)]
    own = [dataclasses.replace(o, choices=("auto", *(r.name for r in recipes))) if o.key == "recipe" else o
           for o in own]
    return (*own, *(o for recipe in recipes for o in recipe.options))


def option_aliases() -> dict[str, str]:
    """Old option keys -> the key they name."""
    return {alias: o.key for o in options_table() for alias in o.aliases}


def __getattr__(name: str) -> Any:
    if name == "OPTIONS":  # the table as the registry stands now (a recipe registered later joins it)
        return options_table()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _deprecated(what: str, old: str, new: str, stacklevel: int) -> None:
    """stacklevel: frames from here up to the caller of Config's public method that met the old name."""
    warnings.warn(f"moepass: {what} {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=stacklevel + 1)


@dataclasses.dataclass(frozen=True)
class Config:
    """Validated options. Read a prefix's options typed with `config.section("lowp").exclude`; `config["lowp.exclude"]`
    reads one by key (an old key reads its new one, with a warning)."""

    values: Mapping[str, Any]
    # sections already read, by prefix: frozen dataclasses of these frozen values, so passes may read them per node
    _sections: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        if key in self.values:
            return self.values[key]
        new = option_aliases().get(key)
        if new is None:
            raise KeyError(key)
        _deprecated("option", key, new, stacklevel=2)
        return self.values[new]

    def section(self, prefix: str):
        """The options under `prefix` ("" for the unprefixed ones, "lowp", "inductor", ..., a recipe's name) as
        their frozen dataclass."""
        if prefix not in self._sections:
            self._sections[prefix] = self._read_section(prefix)
        return self._sections[prefix]

    def _read_section(self, prefix: str):
        from moepass.recipes.registry import RECIPES

        if prefix in SECTIONS:
            return read(SECTIONS[prefix], self.values, prefix)
        if prefix in RECIPES:
            return RECIPES[prefix].read(self.values)
        raise KeyError(f"no options under {prefix!r}; prefixes: {sorted(SECTIONS)} and recipes {sorted(RECIPES)}")

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
        from moepass.recipes.registry import RECIPES

        table = options_table()
        by_key, aliases = {o.key: o for o in table}, option_aliases()
        if not isinstance(options, Mapping):
            raise OptionsError(f"moepass: options must be a dict of option names to values, not "
                               f"{type(options).__name__} {reprlib.repr(options)}. Valid options: {sorted(by_key)}")
        unknown = sorted(set(options) - set(by_key) - set(aliases), key=str)
        if unknown:
            near = [m for u in unknown if isinstance(u, str) for m in difflib.get_close_matches(u, by_key, n=1)]
            raise OptionsError(
                f"moepass: unknown option(s) {unknown}{f' (did you mean {near}?)' if near else ''}. "
                f"Valid options: {sorted(by_key)}"
            )
        options = _new_keys(options, aliases)
        values = {}
        for opt in table:
            value = options.get(opt.key, opt.default)
            if opt.choices is not None and not any(value is c or value == c for c in opt.choices
                                                   if type(value) is type(c)):
                raise OptionsError(
                    f"moepass: option {opt.key!r}={value!r} is not valid; valid values: {list(opt.choices)}"
                )
            if opt.check is not None and not opt.check(value):
                raise OptionsError(f"moepass: option {opt.key!r}={value!r} is not valid; expected {opt.expects}")
            values[opt.key] = _frozen(value)
        for old in (p for p in values["passes"] if p in PASS_ALIASES):
            _deprecated("pass name", old, PASS_ALIASES[old], stacklevel=3)
        values["passes"] = tuple(dict.fromkeys(canonical_pass(p) for p in values["passes"]))
        values["inductor.mode"] = _effective_mode(values["inductor.mode"], mode)
        _check_inductor_patches(values["inductor.options"])
        for recipe in RECIPES.values():  # combinations of its options a recipe refuses
            recipe.check_options(recipe.read(values))
        if values["report_dir"] is not None:
            _check_report_dir(values["report_dir"])
        return cls(values)


def _new_keys(options: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """Old keys renamed to their new ones; an old and a new key for the same option together are an error."""
    renamed = {}
    for key, value in options.items():
        new = aliases.get(key, key)
        if new in renamed:
            given = sorted(k for k in options if aliases.get(k, k) == new)
            raise OptionsError(f"moepass: options {given} name the same option ({new!r} is the new name "
                               "of the others); give it once")
        if new != key:
            _deprecated("option", key, new, stacklevel=4)
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
                           f"Valid options: {sorted(o.key for o in options_table())}")
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
    for o in options_table():  # new names only: old ones still work, with a DeprecationWarning
        default = list(o.default) if isinstance(o.default, tuple) else o.default
        values = f" ({' / '.join(map(str, o.choices))})" if o.choices and o.choices != (True, False) else ""
        rows.append(f"| `{o.key}` | `{default!r}` | {o.help}{values} |")
    return "\n".join(rows)
