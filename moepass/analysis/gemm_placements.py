"""The placements moepass's low-precision GEMM ops serve under tensor parallelism, one mesh dimension at a time, and
the local sizes they leave: one table that the ops' DTensor strategies offer (moepass.ops.lowp.sharding) and that
the passes check before a rewrite (moepass.analysis.sharded_gemm). Each is what torch's own mm / addmm /
_grouped_mm strategies give, so a rewritten GEMM has the communication the BF16 one had:

    linear     x[..., K] @ W[N, K].T      replicated; colwise (W Shard(0) -> y Shard(-1)); rowwise (x Shard(-1),
                                          W Shard(1) -> y Partial); tokens sharded (x Shard(d), W Replicate);
                                          x Partial (a linear map of a pending sum stays a pending sum)
    grouped    x[M, K] @ w_t[E, K, N]     replicated; colwise (w_t Shard(2) -> Shard(1)); rowwise (x Shard(1),
                                          w_t Shard(1) -> Partial); x Partial. Experts sharded (w_t Shard(0)) is
                                          expert parallelism, not a GEMM placement: not served.
    dgrad / wgrad                         the placements their forward's gradients take under the same layouts
"""

from __future__ import annotations


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
