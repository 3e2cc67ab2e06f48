"""Custom ops moving rows between DeepEP's receive order and the experts' pair order, with routing weights.

After ``moepass::ep_dispatch`` row r of recv_x is one token with K slots (a local expert id or -1);
``moepass::ep_expert_major_pairs`` lists the routed slots expert-major: pair p is slot ``pair_slot[p]``,
of row ``pair_slot[p] // K``. Three ops cover the permutation both ways, forward and backward:

    ep_pairs_gather(x[R,H], pair_slot[P], topk, weights[R,K] f32 | None) -> [P,H] x.dtype
        pair p = x[row p] (* weights at slot p)
    ep_pairs_sum(y[P,H], pair_slot[P], num_rows, topk, weights | None, out_dtype, round_terms) -> [R,H] out_dtype
        row r = sum of its pairs (each * weights at its slot), accumulated in fp32; with round_terms each
        product is first rounded to out_dtype, as autograd's backward of a gather (index_add) does
    ep_pairs_weight_grad(pairs[P,H], rows[R,H], pair_slot[P], topk) -> [R,K] f32
        slot (r, k) = dot(pairs[p], rows[r]) for the pair p at that slot, 0 where the slot is not routed here

Each direction is the other's backward, and the weight gradient is the third op. Products and sums are fp32.

The ops run the index ops a hand-written MoE uses (index_select; index_add in pair order, fp32), so an
eagerly run rewritten graph keeps the original's numerics bit for bit. Under Inductor the same code is
their decomposition (``EP_PAIRS_DECOMPOSITIONS``), so Inductor fuses the gathers, weights and casts around
the scatter. Measured on 2xH200 (examples/results/ep_dispatch_2xH200*.json), that fused fp32 index_add
(atomic adds) beat a gather-only formulation (each received row reading its K pairs through an inverse
index) by 6-13% forward+backward, even with the gathers' bounds checks removed.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _check(op: str, pair_slot: Tensor, topk: int, weights: Optional[Tensor], num_rows=None) -> None:
    if pair_slot.dim() != 1 or pair_slot.dtype != torch.int64:
        raise TypeError(f"{op}: pair_slot must be int64 [P]; got {pair_slot.dtype} {tuple(pair_slot.shape)}")
    if topk <= 0:
        raise ValueError(f"{op}: topk must be positive; got {topk}")
    if weights is not None:
        if weights.dtype != torch.float32 or weights.dim() != 2 or weights.shape[1] != topk:
            raise TypeError(f"{op}: weights must be float32 [R, {topk}]; got {weights.dtype} {tuple(weights.shape)}")
        if num_rows is not None:
            torch._check(weights.shape[0] == num_rows, lambda: f"{op}: weights and the rows differ in count")


def _slot_weights(weights: Tensor, pair_slot: Tensor) -> Tensor:
    return weights.reshape(-1).index_select(0, pair_slot).unsqueeze(-1)


# ---- gather: received rows -> pair rows -------------------------------------------------------------

def _gather(x: Tensor, pair_slot: Tensor, topk: int, weights: Optional[Tensor]) -> Tensor:
    pairs = x.index_select(0, torch.div(pair_slot, topk, rounding_mode="floor"))
    if weights is None:
        return pairs
    return (pairs.float() * _slot_weights(weights, pair_slot)).to(x.dtype)


@torch.library.custom_op("moepass::ep_pairs_gather", mutates_args=())
def ep_pairs_gather(x: Tensor, pair_slot: Tensor, topk: int, weights: Optional[Tensor]) -> Tensor:
    _check("ep_pairs_gather", pair_slot, topk, weights, x.shape[0])
    return _gather(x, pair_slot, topk, weights)


@ep_pairs_gather.register_fake
def _(x, pair_slot, topk, weights):
    _check("ep_pairs_gather", pair_slot, topk, weights, x.shape[0])
    return x.new_empty((pair_slot.shape[0], x.shape[1]))


# ---- sum: pair rows -> received rows ----------------------------------------------------------------

def _sum(y: Tensor, pair_slot: Tensor, num_rows: int, topk: int, weights: Optional[Tensor],
         out_dtype: torch.dtype, round_terms: bool) -> Tensor:
    terms = y.float()
    if weights is not None:
        terms = terms * _slot_weights(weights, pair_slot)
    row = torch.div(pair_slot, topk, rounding_mode="floor")
    if round_terms:  # eager autograd of x[row] sums in x's dtype: so do we, bit for bit
        return torch.zeros((num_rows, y.shape[1]), dtype=out_dtype, device=y.device).index_add(
            0, row, terms.to(out_dtype))
    rows = torch.zeros((num_rows, y.shape[1]), dtype=torch.float32, device=y.device)
    return rows.index_add(0, row, terms).to(out_dtype)


@torch.library.custom_op("moepass::ep_pairs_sum", mutates_args=())
def ep_pairs_sum(y: Tensor, pair_slot: Tensor, num_rows: int, topk: int, weights: Optional[Tensor],
                 out_dtype: torch.dtype, round_terms: bool) -> Tensor:
    _check("ep_pairs_sum", pair_slot, topk, weights, num_rows)
    return _sum(y, pair_slot, num_rows, topk, weights, out_dtype, round_terms)


@ep_pairs_sum.register_fake
def _(y, pair_slot, num_rows, topk, weights, out_dtype, round_terms):
    _check("ep_pairs_sum", pair_slot, topk, weights, num_rows)
    return y.new_empty((num_rows, y.shape[1]), dtype=out_dtype)


# ---- the routing weights' gradient ------------------------------------------------------------------

def _weight_grad(pairs: Tensor, rows: Tensor, pair_slot: Tensor, topk: int) -> Tensor:
    row = torch.div(pair_slot, topk, rounding_mode="floor")
    dots = (pairs.float() * rows.float().index_select(0, row)).sum(-1)
    grad = torch.zeros(rows.shape[0] * topk, dtype=torch.float32, device=rows.device)
    return grad.index_copy(0, pair_slot, dots).view(rows.shape[0], topk)


@torch.library.custom_op("moepass::ep_pairs_weight_grad", mutates_args=())
def ep_pairs_weight_grad(pairs: Tensor, rows: Tensor, pair_slot: Tensor, topk: int) -> Tensor:
    _check("ep_pairs_weight_grad", pair_slot, topk, None)
    return _weight_grad(pairs, rows, pair_slot, topk)


@ep_pairs_weight_grad.register_fake
def _(pairs, rows, pair_slot, topk):
    _check("ep_pairs_weight_grad", pair_slot, topk, None)
    return rows.new_empty((rows.shape[0], topk), dtype=torch.float32)


# ---- autograd: each direction's backward is the other direction --------------------------------------

def _gather_setup(ctx, inputs, output):
    x, pair_slot, topk, weights = inputs
    ctx.topk, ctx.num_rows, ctx.x_dtype = topk, x.shape[0], x.dtype
    ctx.weighted = weights is not None
    ctx.save_for_backward(pair_slot, weights, x if ctx.weighted else None)


def _gather_backward(ctx, grad):
    pair_slot, weights, x = ctx.saved_tensors
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = ep_pairs_sum(grad.contiguous(), pair_slot, ctx.num_rows, ctx.topk, weights, ctx.x_dtype, True)
    if ctx.weighted and ctx.needs_input_grad[3]:
        grad_w = ep_pairs_weight_grad(grad.contiguous(), x, pair_slot, ctx.topk)
    return grad_x, None, None, grad_w


def _sum_setup(ctx, inputs, output):
    y, pair_slot, num_rows, topk, weights, out_dtype, round_terms = inputs
    ctx.topk, ctx.y_dtype = topk, y.dtype
    ctx.weighted = weights is not None
    ctx.save_for_backward(pair_slot, weights, y if ctx.weighted else None)


def _sum_backward(ctx, grad):
    pair_slot, weights, y = ctx.saved_tensors
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_y = ep_pairs_gather(grad.contiguous(), pair_slot, ctx.topk, weights).to(ctx.y_dtype)
    if ctx.weighted and ctx.needs_input_grad[4]:
        grad_w = ep_pairs_weight_grad(y, grad.contiguous(), pair_slot, ctx.topk)
    return grad_y, None, None, None, grad_w, None, None


ep_pairs_gather.register_autograd(_gather_backward, setup_context=_gather_setup)
ep_pairs_sum.register_autograd(_sum_backward, setup_context=_sum_setup)


# ---- Inductor decompositions: the same torch code, traced, so Inductor fuses it ------------------------

EP_PAIRS_DECOMPOSITIONS = {
    torch.ops.moepass.ep_pairs_gather.default: _gather,
    torch.ops.moepass.ep_pairs_sum.default: _sum,
    torch.ops.moepass.ep_pairs_weight_grad.default: _weight_grad,
}
