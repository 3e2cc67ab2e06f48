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
import pathlib
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .report import collect
from . import dynamo_flags
from .inductor_stage.cache_key import CompiledGraphAudit, source_hash
from .options import Config, OptionsError
from .pipeline import inductor_stage, run_pipeline
from .recipes import registry
from .report.records import GraphRecord

log = logging.getLogger(__name__)

INDUCTOR_SLOTS = ("pre_grad_custom_pass", "post_grad_custom_post_pass", "joint_custom_pre_pass")
"""Inductor config entries the route fills; one already holding someone else's pass is refused, not replaced."""

# option -> its default: the backend's Inductor controls, which have no meaning when torch.compile drives Inductor
_BACKEND_ONLY = {"inductor": True, "inductor.mode": None, "inductor.options": {}}


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


def _data_hash() -> str:
    """moepass's data files that shape a rewrite (the measured FP8 table), which source_hash (.py only) leaves out."""
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.glob("*.json")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class MoepassPreGradPass(CustomGraphPass):
    """Inductor `pre_grad_custom_pass`: run moepass's pipeline on each Dynamo graph; record it for the report
    and for the compiled-graph audit of the same compile."""

    def __init__(self, config: Config):
        self.config = config
        self.graphs: dict[Any, GraphRecord] = {}  # Dynamo compile id -> the record of its graph

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if not is_dynamo_graph(gm):
            return  # a HOP body: run_pipeline rewrites it from the graph that calls it
        import moepass.ops  # noqa: F401  (registers the custom ops the passes target)

        record = run_pipeline(gm, self.config)
        report = collect.current_report(self.config, None)
        held = report.add_graph(record)
        self.graphs[gm.meta["dynamo_compile_id"]] = (record, lambda: collect.save_graph(report, held))
        if log.isEnabledFor(logging.INFO):
            log.info("%s", report.summary())
        collect.save_graph(report, held)  # to every report_dir of the run; never raises

    def uuid(self) -> str:
        # under "late" timing the cache keys on the graph before this pass: every option must be in the key
        options = json.dumps(self.config.to_dict(), sort_keys=True, default=str)
        return f"moepass-route-{source_hash()}-{_data_hash()}-{hashlib.sha256(options.encode()).hexdigest()[:16]}"


class RouteAudit(CustomGraphPass):
    """Inductor `post_grad_custom_post_pass`: CompiledGraphAudit into the record of the Dynamo graph being compiled."""

    def __init__(self, pre_grad: MoepassPreGradPass, variant: str):
        self.pre_grad = pre_grad
        self.variant = variant

    def __call__(self, graph: fx.Graph) -> None:
        found = self.pre_grad.graphs.get(torch._guards.CompileContext.current_compile_id())
        if found is not None:  # each compiled forward and backward saves the report again, as the backend's does
            record, save = found
            CompiledGraphAudit(record.compiled, self.variant, on_compiled=save)(graph)

    def uuid(self) -> str:
        return CompiledGraphAudit(variant=self.variant).uuid()


def _settled(config: Config) -> Config:
    """The recipes' "auto" options decided once for the process: the table is installed before any graph is seen,
    so as if the weights were sharded by FSDP2 (torchtitan's default; a saved FP8 weight copy would undo it)."""
    return registry.settle(config, weights_sharded=True)


class _Installation:
    """What install() set, and the values it replaced."""

    def __init__(self, config: Config):
        self.config = config
        self.pre_grad = MoepassPreGradPass(config)
        self.inductor = {"pre_grad_custom_pass": self.pre_grad,
                         **inductor_stage(RouteAudit(self.pre_grad, registry.cache_variant(_settled(config))))}
        self.decompositions: dict = {}
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
    state.decompositions = registry.decompositions(_settled(config))
    inductor_table.update(state.decompositions)
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
    for op, fn in state.decompositions.items():
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
