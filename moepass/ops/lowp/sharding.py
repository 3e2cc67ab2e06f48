"""DTensor sharding strategies of moepass's GEMM ops, so a rewritten GEMM runs under tensor parallelism.

A model parallelized with `torch.distributed.tensor.parallel` (or torchtitan's TP) hands Dynamo DTensors; DTensor
dispatches every op through a sharding strategy, and an op without one fails the whole compile. Each GEMM op here
gets the placements of moepass.analysis.gemm_placements (those torch's own mm / addmm / _grouped_mm strategies give,
per mesh dimension, expanded over the mesh by DTensor), so it runs on the local shards with the communication the
BF16 GEMM would have had.

Low-precision numerics per shard: every scale is computed over the local data. MXFP8's 1x32 blocks along K (or N,
or tokens) are the same blocks as unsharded when each shard's size is a multiple of 32, which every strategy
requires (is_valid_strategy_cb below; the passes check it first and leave such a GEMM in BF16 with the reason).
FP8-rowwise scales of a K-sharded (rowwise) GEMM are per row of each shard: a row's amax over K/tp elements,
never coarser than unsharded. Blockwise FP8's 1x128 tiles and 128x128 weight blocks are the unsharded ones when each
shard's K and N are multiples of 128 (the recipe's `multiple`, which the strategies require); its wgrad's tiles down
the tokens are each rank's own when tokens are sharded. A Partial operand is quantized per rank's summand.

No other moepass op sees a DTensor: the FP8-rowwise quantize ops are emitted by Inductor decompositions, which run
below DTensor's dispatch on local tensors, and the deepep pass hands the EP ops each rank's local shard
(`to_local`, moepass.analysis.dtensors), as DeepEP itself takes it.
"""

from __future__ import annotations

import math

import torch

from moepass.analysis.gemm_placements import local_size, single_dim_strategies

# GEMM op kind -> where its K and N are among the tensor arguments: (argument index, dim, name); their local
# sizes must be multiples of the recipe's block
_ALIGNED_DIMS = {
    "linear": ((1, 0, "N"), (1, 1, "K")),  # weight [N, K]
    "linear_dgrad": ((1, 0, "N"), (1, 1, "K")),
    "linear_wgrad": ((0, -1, "N"), (1, -1, "K")),  # grad_out [..., N], x [..., K]
    "grouped_mm": ((1, 1, "K"), (1, 2, "N")),  # w_t [E, K, N]
    "grouped_mm_dgrad": ((1, 1, "K"), (1, 2, "N")),
    "grouped_mm_wgrad": ((0, 1, "N"), (1, 1, "K")),  # grad_out [M, N], x [M, K]
}


def unaligned_dims(gemm: str, shapes: list, placements: list, mesh_shape, multiple: int) -> list[str]:
    """For a GEMM op's tensor inputs (global shapes, placements per mesh dim), the local K / N sizes that are
    not positive multiples of `multiple` (or uneven across ranks), as 'K=16' strings; [] when all are."""
    bad = []
    for arg, dim, name in _ALIGNED_DIMS[gemm]:
        shape = shapes[arg]
        dim = dim % len(shape)
        size = local_size(shape[dim], dim, placements[arg], mesh_shape)
        if size is None:
            bad.append(f"{name}={shape[dim]} split unevenly over {math.prod(mesh_shape)} ranks")
        elif not isinstance(size, int) or size == 0 or size % multiple:
            bad.append(f"{name}={size} per shard")
    return bad


def register_gemm_sharding(op: torch._ops.OpOverload, gemm: str, multiple: int) -> None:
    """Give `op` (a moepass GEMM op of kind `gemm`) DTensor strategies; shards whose local K or N is not a
    multiple of `multiple` are not offered (DTensor would sooner redistribute than run a wrong-sized block)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy

    def strategy(op_schema):
        mesh = op_schema.get_mesh_from_args()
        tensors = [a for a in op_schema.args_schema if isinstance(a, OpStrategy)]
        shapes = [t.strategies[0].output_spec.shape for t in tensors]
        has_bias = gemm == "linear" and len(op_schema.args_schema) > 2 and \
            isinstance(op_schema.args_schema[2], OpStrategy)

        def aligned(input_specs, output_specs) -> bool:
            return not unaligned_dims(gemm, shapes, [s.placements for s in input_specs], mesh.shape, multiple)

        return expand_to_full_mesh_op_strategy(
            mesh, op_schema, list(single_dim_strategies(gemm, tuple(len(s) for s in shapes), has_bias).values()),
            input_index=1, is_valid_strategy_cb=aligned)

    register_op_strategy(op)(strategy)
