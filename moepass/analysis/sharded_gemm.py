"""A GEMM whose operands are DTensors (tensor parallelism): which shards it runs on, or why moepass leaves it alone.

Under `torch.distributed.tensor.parallel` the Dynamo graph holds DTensors, and the low-precision ops run on each
rank's local shards through their DTensor strategies (moepass.ops.lowp.sharding, from the placements of
moepass.analysis.gemm_placements). The passes rewrite such a GEMM only when its operands already have placements one
of those strategies takes as they are, so the rewritten GEMM has exactly the communication the BF16 one had, and they
plan it on its local sizes (the GEMM each rank runs: the recipe's block alignment and recipe=auto's measured speed
are per shard).
"""

from __future__ import annotations

import dataclasses

from torch import fx

from moepass.analysis.graph import tensor_meta
from moepass.skips import Reason, SkipCode

from .dtensors import is_dtensor
from .gemm_placements import local_size, single_dim_strategies


@dataclasses.dataclass(frozen=True)
class ShardedGemm:
    local_shapes: tuple[tuple[int, ...] | None, ...]  # each operand's shape on every rank (None for an absent bias)
    layout: str  # for the report: "colwise on mesh dim tp (2 ranks)"


def sharded_gemm(gemm: str, operands: list[fx.Node | None]) -> ShardedGemm | Reason | None:
    """For a `gemm` ("linear" or "grouped_mm") on `operands` ([x, weight, bias] or [x, w_t, offs]): None when no
    operand is a DTensor, a ShardedGemm when the op's strategies serve their placements as they are, else the
    reason the GEMM stays BF16."""
    values = [tensor_meta(n) if isinstance(n, fx.Node) else None for n in operands]
    present = [v for v in values if v is not None]
    dtensors = [v for v in present if is_dtensor(v)]
    if not dtensors:
        return None
    if len(dtensors) != len(present):
        return Reason(SkipCode.TP_PLACEMENTS, "tensor parallelism: the GEMM mixes DTensor and plain tensor operands "
                      "(DTensor would refuse it too)")
    mesh = dtensors[0].device_mesh
    if any(v.device_mesh != mesh for v in dtensors):
        return Reason(SkipCode.TP_PLACEMENTS, "tensor parallelism: the GEMM's DTensor operands live on different "
                      "device meshes")
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    strategies = single_dim_strategies(gemm, (values[0].dim(), values[1].dim()),
                                       has_bias=gemm == "linear" and values[2] is not None)
    layouts = []
    for i, (name, ranks) in enumerate(zip(names, mesh.shape)):
        given = [v.placements[i] if v is not None else None for v in values]
        layout = next((layout for layout, row in strategies.items() if row[1:] == given), None)
        if layout is None:
            shown = ", ".join(f"{role} {p}" for role, p in zip(("x", "weight", "third operand"), given) if p)
            return Reason(SkipCode.TP_PLACEMENTS,
                          f"tensor parallelism: placements {shown} on mesh dim {name!r} are not ones moepass's "
                          f"low-precision GEMMs take as they are ({', '.join(strategies)}); left BF16 rather than "
                          "redistribute")
        if ranks > 1:
            layouts.append(f"{layout} over {name} ({ranks} ranks)")
    local_shapes = []
    for v in values:
        sizes = None if v is None else tuple(local_size(s, d, v.placements, mesh.shape) for d, s in enumerate(v.shape))
        if sizes is not None and any(s is None for s in sizes):
            return Reason(SkipCode.TP_UNEVEN,
                          f"tensor parallelism: shape {tuple(v.shape)} splits unevenly over mesh {tuple(mesh.shape)} "
                          f"({v.placements}); the low-precision blocks need equal shards; left BF16")
        local_shapes.append(sizes)
    return ShardedGemm(tuple(local_shapes), "; ".join(layouts) or "replicated")
