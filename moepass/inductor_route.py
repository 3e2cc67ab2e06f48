"""moepass inside `backend="inductor"`: the pass pipeline as Inductor's pre-grad custom pass.

For stacks that compile with Inductor by name and nothing else: torchtitan 0.3.0 refuses any other
backend for a model with FlexAttention (every DeepSeek-V3 config it ships), and Inductor is what lowers
flex_attention. `install(options)` puts into `torch._inductor.config` what `moepass_backend` hands
`compile_fx` per call, so every later `torch.compile(..., backend="inductor")` in the process gets it:

    pre_grad_custom_pass         the pipeline, on each graph Dynamo hands Inductor (it walks the HOP bodies
                                 itself: Inductor's calls on the bodies are skipped); records -> the report
    post_grad_custom_post_pass   CompiledGraphAudit, per Dynamo graph (keyed by its compile id: a backward
                                 compiled lazily at its first run still finds its graph)
    joint_custom_pre_pass        SavedForBackward (EP exchanges saved under AC; gathered FP8 rows gathered again)
    pre_grad_pass_timing "early" (torch >= 2.12) the pipeline runs before the AOTAutograd cache lookup, as the
                                 backend's does: the cache keys on the rewritten graph, and a warm cache
                                 still reports every graph's rewrites
    decompositions               the recipes' decompositions (FP8-rowwise "scaled_mm") added to Inductor's
                                 default table (moepass's own ops are their only keys, so no other graph changes)
    Dynamo flags                 capture_scalar_outputs, capture_dynamic_output_shape_ops: on while Dynamo traces a
                                 frame for Inductor, with the backend's fallback (moepass/dynamo_flags.py); never
                                 set in torch._dynamo.config, so other backends' compiles keep theirs

`uninstall()` puts back each value it replaced that still holds what it set. Options: `install(options)`, else
MOEPASS_OPTIONS. `inductor.mode` / `inductor.options` / `inductor=False` do not apply here (torch.compile's own
Inductor settings are used) and are refused. Differences from the backend: a graph Dynamo replays from its cache
inside `moepass.collecting()` is not re-added to that report.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import dynamo_flags
from .inductor_stage.cache_key import CompiledGraphAudit, source_hash
from .options import Config, OptionsError
from .pipeline import InductorHandoff, RewrittenGraph, inductor_handoff, rewrite_and_report
from .recipes import measure

log = logging.getLogger(__name__)

INDUCTOR_SLOTS = ("pre_grad_custom_pass", "post_grad_custom_post_pass", "joint_custom_pre_pass")
"""Inductor config entries the route fills; one already holding someone else's pass is refused, not replaced."""

# option -> its default: the backend's Inductor controls, which have no meaning when torch.compile drives Inductor
_BACKEND_ONLY = {"inductor": True, "inductor.mode": None, "inductor.options": {}}
# the recipes' "auto" options are decided once for the process (the decompositions are installed before any graph is
# seen): as if FSDP2 sharded the weights (torchtitan's default; a saved FP8 weight copy would undo its reshard)
WEIGHTS_SHARDED = True


def route_config(options: dict | None = None) -> Config:
    """Validated options (MOEPASS_OPTIONS when none), refusing the backend's Inductor controls."""
    config = Config.from_options(options)
    given = [k for k, default in _BACKEND_ONLY.items() if config[k] != default]
    if given:
        raise OptionsError(f"moepass: option(s) {given} set how moepass's backend calls Inductor; on the Inductor "
                           "route torch.compile calls Inductor itself: give the mode and Inductor options to "
                           "torch.compile (mode=, options=) and leave these out")
    return config


def is_dynamo_graph(gm: fx.GraphModule | None) -> bool:
    """The graph Dynamo handed Inductor, not a HOP body (AC, flex score/mask) Inductor visits first."""
    return gm is not None and "dynamo_compile_id" in gm.meta


def _measured_verdicts() -> str:
    """recipe="auto"'s verdicts measured on this GPU (recipes.measure's file, as it is now) when the pass runs after
    the cache lookup ("late" timing: a cached graph is then served without it); "" otherwise: the pass runs first, so
    the graph the cache keys on holds what they decided, and the file grows as a run measures (hashing it would miss
    the cache once more for each graph compiled before the last new verdict)."""
    import torch._inductor.config as inductor_config

    if getattr(inductor_config, "pre_grad_pass_timing", "early") == "early" or not torch.cuda.is_initialized():
        return ""  # torch < 2.12 always runs it early; without CUDA nothing is measured
    try:
        return hashlib.sha256(measure.cache_path(torch.cuda.get_device_name()).read_bytes()).hexdigest()[:16]
    except OSError:
        return "unmeasured"


class MoepassPreGradPass(CustomGraphPass):
    """Inductor `pre_grad_custom_pass`: run moepass's pipeline on each Dynamo graph; record it for the report
    and for the compiled-graph audit of the same compile."""

    def __init__(self, config: Config):
        self.config = config
        self.graphs: dict[Any, RewrittenGraph] = {}  # Dynamo compile id -> its graph, rewritten

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if not is_dynamo_graph(gm):
            return  # a HOP body: the pipeline rewrites it from the graph that calls it
        self.graphs[gm.meta["dynamo_compile_id"]] = rewrite_and_report(gm, self.config)

    def uuid(self) -> str:
        # under "late" timing the cache keys on the graph before this pass: every input of the rewrite must be in
        # the key (source_hash holds the sources and the shipped data; then the options and any measured verdicts)
        options = json.dumps(self.config.to_dict(), sort_keys=True, default=str)
        verdicts = _measured_verdicts()
        return f"moepass-route-{source_hash()}-{hashlib.sha256(options.encode()).hexdigest()[:16]}" + \
            (f"-{verdicts}" if verdicts else "")


class RouteAudit(CustomGraphPass):
    """Inductor `post_grad_custom_post_pass`: CompiledGraphAudit into the record of the Dynamo graph being compiled."""

    def __init__(self, pre_grad: MoepassPreGradPass, handoff: InductorHandoff):
        self.pre_grad = pre_grad
        self.handoff = handoff

    def __call__(self, graph: fx.Graph) -> None:
        rewritten = self.pre_grad.graphs.get(torch._guards.CompileContext.current_compile_id())
        if rewritten is not None:  # each compiled forward and backward saves the report again, as the backend's does
            self.handoff.audit(rewritten)(graph)

    def uuid(self) -> str:
        return CompiledGraphAudit(variant=self.handoff.variant).uuid()


class _Installation:
    """What install() set, and the values it replaced."""

    def __init__(self, config: Config):
        self.config = config
        self.pre_grad = MoepassPreGradPass(config)
        self.handoff = inductor_handoff(config, WEIGHTS_SHARDED)
        self.inductor = {"pre_grad_custom_pass": self.pre_grad,
                         **self.handoff.inductor_config(RouteAudit(self.pre_grad, self.handoff))}
        self.replaced: dict[tuple[Any, str], Any] = {}  # (config module, name) -> value before install

    def set(self, module, name: str, value) -> None:
        self.replaced[(module, name)] = getattr(module, name)
        setattr(module, name, value)

    def restore(self) -> None:
        """Put back each replaced value that still holds what install() set (a later change is left alone)."""
        set_values = {**self.inductor, "pre_grad_pass_timing": "early"}
        for (module, name), before in self.replaced.items():
            now = getattr(module, name)
            if now is set_values[name] or (isinstance(now, (bool, str)) and now == set_values[name]):
                setattr(module, name, before)


_installed: _Installation | None = None


def installed() -> Config | None:
    """The options the route is installed with, or None."""
    return _installed.config if _installed is not None else None


def install(options: dict | None = None) -> Config:
    """Run moepass's passes in every later torch.compile(..., backend="inductor") of this process.

    `options`: the backend's options dict (None: MOEPASS_OPTIONS, else defaults). Installing again replaces the
    earlier installation. Raises OptionsError for bad options, ValueError when one of INDUCTOR_SLOTS already
    holds a pass that is not moepass's.
    """
    import torch._inductor.config as inductor_config

    config = route_config(options)
    uninstall()
    taken = {slot: getattr(inductor_config, slot) for slot in INDUCTOR_SLOTS if getattr(inductor_config, slot)}
    if taken:
        raise ValueError(f"moepass: torch._inductor.config already holds {taken}; the Inductor route needs "
                         f"{list(taken)}. Unset them (or compile with backend='moepass') and install again")
    import moepass.ops  # noqa: F401  (registers the ops the decompositions are keyed on)
    from torch._inductor.decomposition import decompositions as inductor_table

    state = _Installation(config)
    for slot, custom_pass in state.inductor.items():
        state.set(inductor_config, slot, custom_pass)
    if hasattr(inductor_config, "pre_grad_pass_timing"):  # torch >= 2.12; earlier ones always run it early
        state.set(inductor_config, "pre_grad_pass_timing", "early")
    dynamo_flags.install()  # the EP flags for Inductor's frames while installed() (it asks), not process-wide
    # the backend passes these as compile_fx(decompositions=); under backend="inductor" the default table is read
    inductor_table.update(state.handoff.decompositions)
    _forget_cached_table()
    global _installed
    _installed = state
    log.info("moepass: Inductor route installed, options %s", config.to_dict())
    return config


def uninstall() -> None:
    """Put back what install() replaced (a no-op when not installed)."""
    global _installed
    state, _installed = _installed, None
    if state is None:
        return
    from torch._inductor.decomposition import decompositions as inductor_table

    state.restore()
    for op, fn in state.handoff.decompositions.items():
        if inductor_table.get(op) is fn:
            del inductor_table[op]
    _forget_cached_table()


def _forget_cached_table() -> None:
    """Inductor copies its default table on first read (`fast_random_decomps`, cached): drop the copy, so an
    installation after an earlier compile in the process is seen (and an uninstalled one is not)."""
    from torch._inductor import decomposition

    cache_clear = getattr(getattr(decomposition, "fast_random_decomps", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


@contextlib.contextmanager
def route(options: dict | None = None):
    """install(options) for the block; yields the Config."""
    config = install(options)
    try:
        yield config
    finally:
        uninstall()
