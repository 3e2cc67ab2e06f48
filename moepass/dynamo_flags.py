"""Dynamo's unbacked-value flags, on for the frames moepass compiles and for no other compile in the process.

EP regions need their host split sizes (`.tolist()`) and data-dependent received row counts inside one graph:
`capture_scalar_outputs` and `capture_dynamic_output_shape_ops`. Set process-wide, they change every compile:
a per-expert loop over `bincount(...).tolist()` counts with `if counts[i] == 0: continue` (DeepSeek-V3's
reference model.py) then fails with GuardOnDataDependentSymNode under any backend. So `install()` scopes them to
Dynamo's trace of one frame, and only of a frame compiled for moepass: by `backend="moepass"`, or by Inductor while
the Inductor route is installed. A frame whose trace fails with them on a data-dependent value (a guard on an
unbacked symbol) is traced again with the user's own values, so it graph-breaks where Inductor's would.

torch 2.11-2.13 offer no narrower public hook: a backend's `backend_ctx_ctor` is hidden by the
`_TorchCompileWrapper` torch.compile puts around a named backend, and would be entered around every call of the
compiled function (its eager parts, and the compiles nested in them) rather than around one frame's trace.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch._dynamo import convert_frame
from torch._dynamo.utils import counters

log = logging.getLogger(__name__)

FLAGS = {"capture_scalar_outputs": True, "capture_dynamic_output_shape_ops": True}
"""What EP regions need while their frame is traced: `.tolist()` split sizes as unbacked SymInts, and ops whose
output size depends on data (the received rows, `nonzero`) traced rather than broken at."""

COUNTER = "moepass"
"""`torch._dynamo.utils.counters[COUNTER]["frames_traced_without_flags"]`: frames traced again without FLAGS."""

_trace_frame = convert_frame.ConvertFrameAssert.__call__  # Dynamo's own: traces one frame and compiles its graphs


def install() -> None:
    """Route Dynamo's trace of each frame through `_trace_with_flags` (once per process; idempotent)."""
    if convert_frame.ConvertFrameAssert.__call__ is not _trace_with_flags:
        # why: no public per-compile hook for Dynamo config; the patch changes nothing for other backends' frames
        convert_frame.ConvertFrameAssert.__call__ = _trace_with_flags


def _trace_with_flags(self, *args, **kwargs):
    """`ConvertFrameAssert.__call__` with FLAGS on while a moepass frame is traced; traced again without them when
    they make its trace fail on a data-dependent value."""
    if "skip" in kwargs:  # frames Dynamo elides from its "start compiling" stack: this one too
        kwargs["skip"] += 1
    try:
        wanted = wants_flags(getattr(self, "_torchdynamo_orig_backend", None))
    except Exception:  # noqa: BLE001 - every frame of every backend passes here: moepass's check never breaks one
        log.debug("moepass: could not tell the frame's backend; traced as it is", exc_info=True)
        wanted = False
    if not wanted:
        return _trace_frame(self, *args, **kwargs)
    config = torch._dynamo.config
    if all(getattr(config, flag) == value for flag, value in FLAGS.items()):
        return _trace_frame(self, *args, **kwargs)  # the user's own settings: nothing to scope, nothing to fall back to
    try:
        with config.patch(FLAGS):
            return _trace_frame(self, *args, **kwargs)
    except Exception as error:
        if not is_data_dependent(error):
            raise
        code = getattr(args[0], "f_code", None) if args else None
        where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"
        log.info("moepass: %s cannot be traced with %s (%s: %s); traced as Inductor would, breaking the graph there",
                 where, ", ".join(FLAGS), type(error).__name__, str(error).split("\n", 1)[0])
        counters[COUNTER]["frames_traced_without_flags"] += 1
    return _trace_frame(self, *args, **kwargs)


def is_data_dependent(error: BaseException) -> bool:
    """The error, or one it was raised from, is a guard on a data-dependent (unbacked) value: Dynamo raises it as
    GuardOnDataDependentSymNode, or wraps it in a UserError ("Consider annotating your code using torch._check*()")."""
    from torch._dynamo.exc import UserError
    from torch.fx.experimental import symbolic_shapes

    kinds = tuple(k for k in (symbolic_shapes.GuardOnDataDependentSymNode,
                              getattr(symbolic_shapes, "PendingUnbackedSymbolNotFound", None), UserError) if k)
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kinds):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


# the attributes a backend is reached through: Dynamo's debug wrapper, torch.compile's wrapper of a named or
# callable backend, functools.partial, DDPOptimizer's per-bucket compile_fn (a bound method)
_INNER = ("_torchdynamo_orig_backend", "__wrapped__", "compiler_fn", "func", "__self__", "backend_compile_fn")


def backends(compiler_fn) -> list:
    """Every object on the wrapper chain from the backend Dynamo holds to the user's backend."""
    found, todo, seen = [], [compiler_fn], set()
    while todo and len(found) < 32:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        found.append(fn)
        todo.extend(getattr(fn, name, None) for name in _INNER)
    return found


def wants_flags(compiler_fn) -> bool:
    """The frame is compiled for moepass: by its backend, or by Inductor while the Inductor route is installed."""
    chain = backends(compiler_fn)
    backend = sys.modules.get("moepass.backend")  # not imported: no frame is compiled by it
    if backend is not None and any(fn is backend.moepass_backend for fn in chain):
        return True
    route = sys.modules.get("moepass.inductor_route")  # not imported: not installed
    return route is not None and route.installed() is not None and any(map(_is_inductor, chain))


def _is_inductor(fn) -> bool:
    if isinstance(fn, torch._TorchCompileInductorWrapper):
        return True
    from torch._dynamo.backends.registry import lookup_backend
    from torch._inductor.compile_fx import compile_fx

    return fn is compile_fx or fn is lookup_backend("inductor")
