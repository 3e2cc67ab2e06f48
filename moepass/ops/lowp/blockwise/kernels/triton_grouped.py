"""Blockwise FP8 grouped GEMMs as two Triton kernels (kernel "triton"): every token group in one launch, no host sync.

The two forms of gemm._grouped_mm_nt (out = A @ B.T per group, both operands K-major, dequantization factors as
scales), which kernel "scaled_mm" runs as one torch._scaled_mm per group after reading the group bounds on the host:
  M-grouped (forward, dgrad): a [M, K] tokens in 1x128 tiles (a_scale [M, K/128]), b [E, N, K] in 128x128 blocks
      (b_scale [E, N/128, K/128]); out [M, N], rows of group g times b[g], rows at or after ends[-1] zero.
  K-grouped (wgrad): a [N, P] and b [K, P], both in 1x128 tiles along the P tokens (scales [N, P/128], [K, P/128]),
      groups ending at `ends`, each a whole number of tiles; out [E, N, K], group g's tokens only (empty groups zero).
Each 128-wide K block's tensor-core product is scaled and added to an fp32 accumulator (DeepSeek-V3's promotion: the
block's partial sum never accumulates across blocks in the tensor core's narrower accumulator). The M-grouped kernel
maps its programs onto (group, row tile) from the group ends inside the kernel, with one extra group for the rows
after the last end, which it writes as zeros.

Imported only where the kernel runs (CUDA with triton); gemm.blockwise_triton_grouped_mm is the op around it, and
choice.py checks it once per device against the emulated GEMM before choosing it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..quant import TILE  # the scales' granularity: one K step of the kernels
BF16 = torch.bfloat16

# BLOCK_N divides 128 (one weight-block scale per K step); 128x128 at most: the promotion keeps the block's product
# beside the accumulator, two fp32 tiles in registers
CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
           for bm, bn, w, s in ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 4, 4))]
GROUP_M = 8  # the M-grouped kernel runs 8 row tiles across every column tile before the next 8: A stays in L2


@triton.autotune(configs=CONFIGS, key=["N", "K"])
@triton.jit
def _m_grouped_kernel(a, a_s, b, b_s, ends, out, M, N, K, E,
                      sa_m, sa_k, ssa_m, ssa_k, sb_e, sb_n, sb_k, ssb_e, ssb_n, ssb_k, so_m, so_n,
                      E_PAD: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    # program -> (row-tile slot, column tile), GROUP_M slots at a time across all column tiles; the slots: every
    # group's row tiles (at most one partial tile each) and the tail's
    slots = tl.cdiv(M, BLOCK_M) + E + 1
    width = GROUP_M * tl.cdiv(N, BLOCK_N)
    first = tl.program_id(0) // width * GROUP_M
    height = tl.minimum(slots - first, GROUP_M)
    pid = first + tl.program_id(0) % width % height
    pid_n = tl.program_id(0) % width // height
    # group bounds: entry E is the tail [ends[E-1], M), entries after it are empty
    idx = tl.arange(0, E_PAD)
    end = tl.where(idx < E, tl.load(ends + idx, mask=idx < E, other=0).to(tl.int32), M)
    start = tl.load(ends + idx - 1, mask=(idx >= 1) & (idx <= E), other=0).to(tl.int32)
    start = tl.where(idx > E, M, start)
    tiles = (tl.maximum(end - start, 0) + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(tiles, 0)  # programs [last - tiles, last) serve group idx
    g = tl.sum((last <= pid).to(tl.int32), 0)
    if g > E:
        return
    mine = idx == g
    g_end = tl.sum(tl.where(mine, end, 0), 0)
    row0 = tl.sum(tl.where(mine, start, 0), 0) + (pid - tl.sum(tl.where(mine, last - tiles, 0), 0)) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < g_end, cols < N
    rows64, cols64, g64 = rows.to(tl.int64), cols.to(tl.int64), g.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a + rows64[:, None] * sa_m + ks[None, :] * sa_k
    b_ptrs = b + g64 * sb_e + cols64[None, :] * sb_n + ks[:, None] * sb_k  # [BLOCK_K, BLOCK_N], K-major
    a_s_ptrs = a_s + rows64 * ssa_m
    b_s_ptr = b_s + g64 * ssb_e + (pid_n * BLOCK_N // BLOCK_K) * ssb_n  # BLOCK_N divides 128: one block column
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = 0  # the tail group: zeros
    if g < E:
        k_steps = tl.cdiv(K, BLOCK_K)
    for kb in range(0, k_steps):
        a_tile = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b_tile = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        a_scale = tl.load(a_s_ptrs + kb * ssa_k, mask=row_ok, other=0.0)
        b_scale = tl.load(b_s_ptr + kb * ssb_k)
        acc += tl.dot(a_tile, b_tile) * a_scale[:, None] * b_scale
        a_ptrs += BLOCK_K * sa_k
        b_ptrs += BLOCK_K * sb_k
    o_ptrs = out + rows64[:, None] * so_m + cols64[None, :] * so_n
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.autotune(configs=CONFIGS, key=["N", "K"])
@triton.jit
def _k_grouped_kernel(a, a_s, b, b_s, ends, out, N, K,
                      sa_n, sa_p, ssa_n, ssa_p, sb_k, sb_p, ssb_k, ssb_p, so_e, so_n, so_k,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # column tiles fastest, then row tiles, then groups: neighbouring programs share a's rows and the group
    pid_n, pid_m, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(ends + tl.maximum(g - 1, 0)).to(tl.int32)
    start = tl.where(g > 0, start, 0)
    end = tl.load(ends + g).to(tl.int32)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # of N
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # of K
    row_ok, col_ok = rows < N, cols < K
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    ps = start + tl.arange(0, BLOCK_K)
    a_ptrs = a + rows64[:, None] * sa_n + ps[None, :] * sa_p
    b_ptrs = b + cols64[None, :] * sb_k + ps[:, None] * sb_p  # [BLOCK_K tokens, BLOCK_N], token-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(start // BLOCK_K, end // BLOCK_K):
        a_tile = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        b_tile = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        a_scale = tl.load(a_s + rows64 * ssa_n + t * ssa_p, mask=row_ok, other=0.0)
        b_scale = tl.load(b_s + cols64 * ssb_k + t * ssb_p, mask=col_ok, other=0.0)
        acc += tl.dot(a_tile, b_tile) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K * sa_p
        b_ptrs += BLOCK_K * sb_p
    o_ptrs = out + g.to(tl.int64) * so_e + rows64[:, None] * so_n + cols64[None, :] * so_k
    tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launcher(autotuned, config: triton.Config | None):
    """The autotuned kernel, or (config given) the kernel itself at that one config: Triton's interpreter cannot time
    configs, and a test runs every config so."""
    if config is None:
        return autotuned, {}
    return autotuned.fn, {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _column_major(scale: Tensor) -> Tensor:
    """[R, C] scales with strides (1, R): the kernels read one scale column (R rows' scales of a K step) per step."""
    return scale.t().contiguous().t()


def m_grouped_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, ends: Tensor,
                    config: triton.Config | None = None) -> Tensor:
    """bf16 [M, N]: a_q[group g] @ b_q[g].T, rows after ends[-1] zero (the M-grouped form above)."""
    (m, k), (e, n, _) = a_q.shape, b_q.shape
    if k % TILE or n % TILE:
        raise ValueError(f"blockwise grouped GEMM: K={k} and N={n} must be multiples of {TILE} (whole 128x128 blocks)")
    out = a_q.new_empty(m, n, dtype=BF16)
    if m == 0 or n == 0:
        return out
    if k == 0 or e == 0:
        return out.zero_()
    kernel, fixed = _launcher(_m_grouped_kernel, config)
    a_scale = _column_major(a_scale)
    grid = lambda meta: ((triton.cdiv(m, meta["BLOCK_M"]) + e + 1) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](a_q, a_scale, b_q, b_scale, ends, out, m, n, k, e,
                 *a_q.stride(), *a_scale.stride(), *b_q.stride(), *b_scale.stride(), *out.stride(),
                 E_PAD=triton.next_power_of_2(e + 1), GROUP_M=GROUP_M, BLOCK_K=TILE, **fixed)
    return out


def k_grouped_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, ends: Tensor,
                    config: triton.Config | None = None) -> Tensor:
    """bf16 [E, N, K]: a_q[:, group g] @ b_q[:, group g].T (the K-grouped form above)."""
    (n, _), k, e = a_q.shape, b_q.shape[0], ends.shape[0]
    out = a_q.new_empty(e, n, k, dtype=BF16)
    if out.numel() == 0:
        return out
    kernel, fixed = _launcher(_k_grouped_kernel, config)
    a_scale, b_scale = _column_major(a_scale), _column_major(b_scale)
    grid = lambda meta: (triton.cdiv(k, meta["BLOCK_N"]), triton.cdiv(n, meta["BLOCK_M"]), e)  # noqa: E731
    kernel[grid](a_q, a_scale, b_q, b_scale, ends, out, n, k,
                 *a_q.stride(), *a_scale.stride(), *b_q.stride(), *b_scale.stride(), *out.stride(),
                 BLOCK_K=TILE, **fixed)
    return out


def grouped_mm_nt(a_q: Tensor, a_scale: Tensor, b_q: Tensor, b_scale: Tensor, ends: Tensor,
                  config: triton.Config | None = None) -> Tensor:
    """gemm._grouped_mm_nt's two forms (3-D b_q: M-grouped; 2-D: K-grouped) on the Triton kernels."""
    form = m_grouped_mm_nt if b_q.dim() == 3 else k_grouped_mm_nt
    return form(a_q, a_scale, b_q, b_scale, ends, config)
