"""The `moepass` torch.compile backend: validate options, run the pass pipeline, hand off to Inductor.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so
`torch.compile(model, backend="moepass")` works without importing moepass first. This function
must not also register itself by name: Dynamo would then see the name twice.
"""

from __future__ import annotations

import sys

from torch import fx

from .report import collect
from . import dynamo_flags
from .options import Config
from .pipeline import inductor_handoff, rewrite_and_report

# EP regions need host split sizes (.tolist()) and data-dependent receive sizes inside one graph: the Dynamo flags
# for that are turned on while a frame compiled for moepass is traced, never process-wide (other compiles keep theirs)
dynamo_flags.install()


def inductor_patches(config: Config) -> dict:
    """The Inductor config the user asked for: the mode's patches (`inductor.mode` or torch.compile's mode=)
    first, then `inductor.options` over them."""
    import torch._inductor

    inductor = config.section("inductor")
    mode = inductor.mode
    patches = dict(torch._inductor.list_mode_options(mode)) if mode not in (None, "default") else {}
    patches.update(inductor.options)
    return patches


def _compile_call():
    """The torch.compile call compiling this graph: torch wraps a named backend in a `_TorchCompileWrapper` per
    call, whose `__call__` is our caller. None when called some other way (then reports group by options)."""
    caller = sys._getframe(2).f_locals.get("self")
    return caller if type(caller).__name__ == "_TorchCompileWrapper" else None


def moepass_backend(gm: fx.GraphModule, example_inputs, *, mode: str | None = None, options: dict | None = None):
    config = Config.from_options(options, mode)
    rewritten = rewrite_and_report(gm, config, _compile_call())
    if not config.section("").inductor:  # the custom ops carry their own autograd, so eager training works too
        return collect.reporting_runs(gm.forward, rewritten.record)
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    # the recipes' "auto" decomposition options decided for this graph (weights sharded by FSDP2 or not)
    handoff = inductor_handoff(config, rewritten.record.weights_sharded)
    # moepass's own entries last (options.MOEPASS_INDUCTOR_PATCHES: inductor.options may not set them)
    patches = {**inductor_patches(config), **handoff.inductor_config(handoff.audit(rewritten))}
    # the recipes' decompositions over Inductor's table (FP8-rowwise "scaled_mm" ops become plain torch here, so
    # Inductor fuses their quantization)
    decompositions = {**select_decomp_table(), **handoff.decompositions}
    compiled = compile_fx(gm, example_inputs, config_patches=patches, decompositions=decompositions)
    return collect.reporting_runs(compiled, rewritten.record)


# torch._dynamo.reset() calls reset() on the backends it cached: the process-wide report goes with the caches
moepass_backend.reset = collect.forget
