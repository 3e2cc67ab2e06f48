"""Autocast regions, and what one GEMM's precision is: BF16 as the graph holds it, BF16 by autocast, or not BF16.

Dynamo does not apply autocast to the graph it records. A region entered inside the compiled function shows as
`torch.amp.autocast_mode._enter_autocast(device_type, dtype, enabled, cache)` / `_exit_autocast(enter)` nodes (or a
`wrap_with_autocast` body), one entered around the call shows nothing: its state is live while the backend runs, and
Dynamo guards on it. Inside either, a linear still reads FP32 operands; autocast casts them at dispatch. Dynamo's
fake-tensor propagation did run under autocast, so a GEMM that autocast runs in BF16 records a bfloat16 output over
float32 operands: that output dtype is the dispatch truth this module reads. The region names what the reason says.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import fx

from moepass.skips import Reason, SkipCode

from .graph import tensor_meta
from .scopes import Scope, hop_name

BF16 = torch.bfloat16
AMBIENT_DEVICES = ("cpu", "cuda")  # the autocast states read around the call
_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast
FIX = ("train in bfloat16 (model.to(torch.bfloat16) / FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16)) or run "
       "the step under torch.autocast(device_type, dtype=torch.bfloat16)")


@dataclasses.dataclass(frozen=True)
class AutocastRegion:
    device_type: str
    dtype: torch.dtype
    enabled: bool
    entered: str  # "inside the compiled function" or "around the call"

    def __str__(self) -> str:
        enabled = "" if self.enabled else ", enabled=False"
        return f"torch.autocast({self.device_type!r}, dtype={self.dtype}{enabled}) entered {self.entered}"


def _region(device_type, dtype, enabled) -> AutocastRegion:
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.get_autocast_dtype(device_type)
    return AutocastRegion(device_type, dtype, bool(enabled), "inside the compiled function")


def ambient_regions() -> tuple[AutocastRegion, ...]:
    """The regions live around the call: read while the backend runs (Dynamo guards on them)."""
    return tuple(AutocastRegion(d, torch.get_autocast_dtype(d), True, "around the call")
                 for d in AMBIENT_DEVICES if torch.is_autocast_enabled(d))


def regions_at(node: fx.Node, scope: Scope) -> tuple[AutocastRegion, ...]:
    """Every autocast region `node` (a node of `scope`'s graph) runs in, outermost first: those around the call, then
    those of the graphs calling this body, then the enter nodes before it in its own graph that no exit closed."""
    if scope.parent is None:
        outer = ambient_regions()
    else:
        call = scope.calls[0]
        outer = regions_at(call, scope.parent)
        if hop_name(call) == "wrap_with_autocast":  # wrap_with_autocast(device_type, dtype, enabled, cache, body, *)
            outer += (_region(*call.args[:3]),)
    graph = scope.graph  # find_nodes reads FX's index of targets: no walk over the graph per GEMM
    entered = sorted(n for n in graph.find_nodes(op="call_function", target=_ENTER) if n < node)
    closed = {n.args[0] for n in graph.find_nodes(op="call_function", target=_EXIT) if n < node and n.args}
    return outer + tuple(_region(*n.args[:3]) for n in entered if n not in closed)


def region_for(node: fx.Node, scope: Scope, device_type: str) -> AutocastRegion | None:
    """The innermost region that decides how autocast treats ops on `device_type` tensors at `node`, or None."""
    return next((r for r in reversed(regions_at(node, scope)) if r.device_type == device_type), None)


@contextlib.contextmanager
def replay(node: fx.Node, scope: Scope):
    """The regions entered inside the compiled function around `node`, entered again: a node a pass adds there gets
    the value Dynamo would have recorded (those around the call are live already)."""
    with contextlib.ExitStack() as stack:
        for r in regions_at(node, scope):
            if r.entered != "around the call":
                stack.enter_context(torch.autocast(r.device_type, dtype=r.dtype, enabled=r.enabled))
        yield


@dataclasses.dataclass(frozen=True)
class Bf16Gemm:
    """A GEMM the low-precision passes may rewrite: its operands as the op takes them."""

    cast: tuple[str, ...]  # operands (by name) cast to bfloat16 before the op, as autocast casts them at dispatch
    region: AutocastRegion | None  # the region running it in BF16; None: BF16 as the graph holds it

    def __str__(self) -> str:
        return "" if self.region is None else f"; BF16 by {self.region}"


def gemm_precision(node: fx.Node, scope: Scope, op: str, operands: dict[str, fx.Node | None]) -> Bf16Gemm | Reason:
    """How `node`, a GEMM named `op` on `operands` (by name; the one named "weight" the low-precision ops take in
    float32 as well), runs: BF16 as it is, BF16 by autocast (the operands to cast), or why it is not BF16.

    The output dtype Dynamo recorded decides (bfloat16 over float32 operands: autocast ran it in BF16); the region the
    node sits in names the reason."""
    values = {name: tensor_meta(n) for name, n in operands.items() if n is not None}
    missing = [name for name, n in operands.items() if n is not None and values[name] is None]
    out = tensor_meta(node)
    if missing or out is None:
        return Reason(SkipCode.NO_METADATA, f"{(missing or ['output'])[0]} has no recorded tensor metadata")
    if all(v.dtype == BF16 for v in values.values()):
        return Bf16Gemm((), None)
    region = region_for(node, scope, next(iter(values.values())).device.type)
    if out.dtype == BF16 and all(v.dtype in (BF16, torch.float32) for v in values.values()):
        return Bf16Gemm(tuple(n for n, v in values.items() if v.dtype != BF16 and n != "weight"), region)
    name, value = next((n, v) for n, v in values.items() if v.dtype != BF16)
    return Reason(SkipCode.NOT_BF16, _not_bf16(op, name, value.dtype, out.dtype, region))


def _not_bf16(op: str, name: str, dtype: torch.dtype, out: torch.dtype, region: AutocastRegion | None) -> str:
    """The NOT_BF16 text for a GEMM whose output is `out`: what runs it so, and the fix (each has "not bfloat16")."""
    if region is not None and region.enabled and out == region.dtype != BF16:
        return (f"autocast runs it in {out}, not bfloat16 ({region}): use torch.autocast(..., dtype=torch.bfloat16)")
    if region is not None and region.enabled and region.dtype == BF16 and out == dtype == torch.float32:
        return (f"autocast leaves {op} in {out}, not bfloat16 ({region}; {op} is not on autocast's lower-precision "
                f"list): cast its operands to bfloat16 in the model, as torchtitan does (x.bfloat16(), "
                f"w.bfloat16())")
    if region is not None and not region.enabled:
        return f"{name} is {dtype}, not bfloat16, and autocast is off here ({region}): {FIX}"
    return f"{name} is {dtype}, not bfloat16, and no BF16 autocast region runs it: {FIX}"
