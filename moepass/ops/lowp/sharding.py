"""DTensor sharding strategies of moepass's GEMM ops, so a rewritten GEMM runs under tensor parallelism.

A model parallelized with `torch.distributed.tensor.parallel` (or torchtitan's TP) hands Dynamo DTensors; DTensor
dispatches every op through a sharding strategy, and an op without one fails the whole compile. Each GEMM op here
gets the placements torch's own mm / addmm / _grouped_mm strategies give (per mesh dimension, expanded over the
mesh by DTensor), so it runs on the local shards with the communication the BF16 GEMM would have had:

    linear     x[..., K] @ W[N, K].T      replicated; colwise (W Shard(0) -> y Shard(-1)); rowwise (x Shard(-1),
                                          W Shard(1) -> y Partial); tokens sharded (x Shard(d), W Replicate);
                                          x Partial (a linear map of a pending sum stays a pending sum)
    grouped    x[M, K] @ w_t[E, K, N]     replicated; colwise (w_t Shard(2) -> Shard(1)); rowwise (x Shard(1),
                                          w_t Shard(1) -> Partial); x Partial. Experts sharded (w_t Shard(0)) is
                                          expert parallelism, not a GEMM placement: not served.
    dgrad / wgrad                         the placements their forward's gradients take under the same layouts

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


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Partial(), Replicate(), Shard


def single_dim_strategies(gemm: str, ndims: tuple[int, ...], has_bias: bool = False) -> dict[str, list]:
    """{layout name: [output, *tensor inputs] placements} on one mesh dimension that `gemm` serves (ndims: the
    first two inputs' ranks; a linear without bias gets None in the bias position)."""
    P, R, S = _placements()
    if gemm in ("linear", "linear_dgrad", "linear_wgrad"):
        last = ndims[0] - 1  # x's (or grad_out's) feature dim; the leading ones are tokens
        tokens = {f"tokens sharded (dim {d})": d for d in range(last)}
        if gemm == "linear":  # x, W, bias: a rowwise bias joins the pending sum as addmm's does
            rows = {"replicated": [R, R, R, R], "colwise": [S(last), R, S(0), S(0)], "rowwise": [P, S(last), S(1), P],
                    "partial x": [P, P, R, P], **{name: [S(d), S(d), R, R] for name, d in tokens.items()}}
            return {name: r if has_bias else r[:3] + [None] for name, r in rows.items()}
        if gemm == "linear_dgrad":  # grad_out [..., N], W [N, K] -> [..., K]
            return {"replicated": [R, R, R], "colwise": [P, S(last), S(0)], "rowwise": [S(last), R, S(1)],
                    "partial grad": [P, P, R], **{name: [S(d), S(d), R] for name, d in tokens.items()}}
        # linear_wgrad: grad_out [..., N], x [..., K] -> [N, K]
        return {"replicated": [R, R, R], "colwise": [S(0), S(last), R], "rowwise": [S(1), R, S(last)],
                "partial grad": [P, P, R], "partial x": [P, R, P],
                **{name: [P, S(d), S(d)] for name, d in tokens.items()}}
    if gemm == "grouped_mm":  # x [M, K], w_t [E, K, N], offs [E] -> [M, N]
        return {"replicated": [R, R, R, R], "colwise": [S(1), R, S(2), R], "rowwise": [P, S(1), S(1), R],
                "partial x": [P, P, R, R]}
    if gemm == "grouped_mm_dgrad":  # grad_out [M, N], w_t [E, K, N], offs -> [M, K]
        return {"replicated": [R, R, R, R], "colwise": [P, S(1), S(2), R], "rowwise": [S(1), R, S(1), R],
                "partial grad": [P, P, R, R]}
    if gemm == "grouped_mm_wgrad":  # grad_out [M, N], x [M, K], offs -> [E, K, N]
        return {"replicated": [R, R, R, R], "colwise": [S(2), S(1), R, R], "rowwise": [S(1), R, S(1), R],
                "partial grad": [P, P, R, R], "partial x": [P, R, P, R]}
    raise ValueError(f"no sharding strategies for GEMM kind {gemm!r}")


def local_size(size, dim: int, placements, mesh_shape):
    """The size of tensor dim `dim` on every rank under `placements` (a SymInt stays one where the dim is not
    sharded), or None when the shards are uneven or the sharded size is not a known int."""
    for placement, ranks in zip(placements, mesh_shape):
        if placement.is_shard(dim):
            if not isinstance(size, int) or size % ranks:
                return None
            size //= ranks
    return size


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
