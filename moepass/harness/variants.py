"""The ways to run one training step that bench and converge compare: eager, Inductor, each pass, all passes."""

from __future__ import annotations

import dataclasses
import json

import torch

from ..options import DEFAULT_PASSES, PASS_ALIASES, PASS_NEEDS, PIPELINE, Config
from .peers import PEERS, convert_to_peer, inductor_options, peer_problem

BASELINE = "inductor"  # BF16 through Inductor: what every speedup and loss gap is measured against


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the same training step: eager, or torch.compile with a backend and options."""

    name: str
    backend: str | None  # None: eager, no torch.compile
    options: dict | None = None
    peer: str | None = None  # a peer recipe (peers.PEERS) the model is converted to before compiling

    def problem(self, device: torch.device) -> str | None:
        """Why this variant cannot run on `device`, or None."""
        return peer_problem(self.peer, device) if self.peer else None

    def prepare(self, model: torch.nn.Module) -> dict | None:
        """Convert the freshly built model for a peer recipe (before its optimizer is built); what changed."""
        return convert_to_peer(self.peer, model) if self.peer else None

    def compile(self, fn):
        """`fn` (a module or a function) compiled as this variant runs it."""
        if self.backend is None:
            return fn
        kwargs = {"options": dict(self.options)} if self.options is not None else {}
        return torch.compile(fn, backend=self.backend, **kwargs)


def variant_names() -> list[str]:
    return ["eager", "inductor", *PIPELINE, "all", *PEERS]


def default_variant_names(ep: int) -> list[str]:
    names = ["inductor", "grouped_mm", "linear", "all"]
    return names[:1] + ["deepep"] + names[1:] if ep > 1 else names


def resolve_variants(names: list[str], options: dict | None = None,
                     custom: dict[str, dict] | None = None) -> list[Variant]:
    """Variant names -> Variants; `options` (user backend options) go to every moepass variant.

    "moepass" is another name for "all" (the default passes), the name `moepass converge` reports under; a pass's
    own variant also runs the pass whose ops it rewrites (options.PASS_NEEDS: quantize_once runs after grouped_mm).
    `custom`: {label: options} adds moepass variants after the named ones, each running the default passes (or
    its own "passes") with `options` updated by its own, to A/B options side by side in one run.
    """
    options = dict(options or {})
    Config.from_options(options)  # a bad --options fails here, before any model is built
    known = [*variant_names(), "moepass", *PASS_ALIASES]  # old pass names still name their pass
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"moepass: unknown variant(s) {unknown}; valid variants: {known}")
    clash = [label for label in custom or {} if label in known or label in names]
    if len(set(names)) != len(names) or clash:
        raise ValueError(f"moepass: variant listed twice in {names + list(custom or {})}"
                         + (f" ({clash} {'is a' if len(clash) == 1 else 'are'} built-in name(s))" if clash else ""))
    out = []
    for n in names:
        if n == "eager":
            out.append(Variant(n, None))
        elif n == "inductor":
            out.append(Variant(n, "inductor"))
        elif n in PEERS:  # what users run instead: torchtitan's torchao recipe, compiled by Inductor
            out.append(Variant(n, "inductor", inductor_options(n), peer=n))
        else:
            passes = list(DEFAULT_PASSES) if n in ("all", "moepass") else [*PASS_NEEDS.get(n, ()), n]
            out.append(Variant(n, "moepass", {**options, "passes": passes}))
    for label, own in (custom or {}).items():
        merged = {"passes": list(DEFAULT_PASSES), **options, **own}
        Config.from_options(merged)
        out.append(Variant(label, "moepass", merged))
    return out


def parse_custom_variant(spec: str) -> tuple[str, dict]:
    """--variant LABEL=JSON -> (LABEL, options)."""
    label, sep, text = spec.partition("=")
    try:
        own = json.loads(text) if sep else None
    except json.JSONDecodeError as e:
        own, why = None, f": {e}"
    else:
        why = ""
    if not label.strip() or not isinstance(own, dict):
        raise ValueError(f"moepass: --variant {spec!r} must be LABEL=JSON-object, e.g. "
                         f"'wgrad_bf16={{\"fp8_rowwise.wgrad_bf16\": true}}'{why}")
    return label.strip(), own
