"""DTensors in a Dynamo graph, seen the way the EP analysis needs them: as each rank's local data.

Under torchtitan's DTensor tensor parallelism (spmd_backend="partial_dtensor") the router runs on DTensors and the
expert-parallel region starts at their `to_local()`: the top-k ids and the per-expert counts a rank sends are
computed on DTensors sharded over tokens. A rank's EP exchange is about its own tokens, so the analysis reads every
DTensor by its local shard: local shapes, `to_local` / `from_local` as the identity on local values, and a DTensor
op evaluated as the same op on the local shards, which is what DTensor itself runs when no communication is needed.
Where it would communicate (a redistribute, a Partial input that must be reduced first, a Shard input whose
output is Replicate), the slice is not evaluable and the region is left alone.
"""

from __future__ import annotations

from torch import fx

from moepass.analysis.graph import example_value

_LOCAL_VIEWS = {"to_local", "from_local"}  # a DTensor's local data and the DTensor built on local data
_COMMUNICATING = {"redistribute", "full_tensor"}


def is_dtensor(value) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


def local_value(value):
    """A DTensor's local (fake) tensor; anything else as it is."""
    return value._local_tensor if is_dtensor(value) else value


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def is_local_view(node: fx.Node) -> bool:
    """`dt.to_local()` or `DTensor.from_local(t, ...)`: on local values, the identity."""
    return node.op in ("call_method", "call_function") and _name(node) in _LOCAL_VIEWS


def communication(node: fx.Node) -> str | None:
    """Why running `node` on local shards would not be what DTensor runs (it communicates), or None."""
    if node.op not in ("call_method", "call_function") or is_local_view(node):
        return None
    if _name(node) in _COMMUNICATING:
        return f"{node.name} redistributes a DTensor"
    out = example_value(node)
    inputs = [example_value(a) for a in node.all_input_nodes]
    dtensors = [v for v in inputs if is_dtensor(v)]
    if not dtensors:
        return None
    for i in range(dtensors[0].device_mesh.ndim):
        if any(v.placements[i].is_partial() for v in dtensors):
            return f"{node.name} reads a Partial DTensor (a pending sum DTensor reduces first)"
        if is_dtensor(out) and out.placements[i].is_replicate() and any(v.placements[i].is_shard() for v in dtensors):
            return f"{node.name} turns a sharded DTensor into a replicated one (DTensor gathers first)"
    return None
