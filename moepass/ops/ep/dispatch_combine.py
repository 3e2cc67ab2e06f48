"""Custom ops ``moepass::ep_dispatch`` / ``moepass::ep_combine``: expert-parallel token exchange.

Semantics are DeepEP V1 normal mode. Two implementations (backend.EPBackend) sit behind one schema, named by the
``backend`` string the pass bakes into the graph: "deepep" (deepep.DeepEP: ``deep_ep.Buffer``, CUDA: NVLink within a
node, RDMA across nodes) or "reference" (reference.ReferenceEP: torch.distributed all_to_all_single; gloo or NCCL);
each op body looks the object up by that name (ep_backend). The process group travels as its name,
as in ``_c10d_functional``. Receive sizes are data dependent: the fake kernels return them as unbacked
SymInts, and every later size is read off the handle's tensors, so one graph covers forward and backward.

    ep_dispatch(x[N,H], topk_idx[N,K] int64, topk_weights[N,K] f32, num_experts, group_size, group_name, backend)
        -> recv_x[R,H], recv_topk_idx[R,K] int64 (local id or -1), recv_topk_weights[R,K] f32 (0 where -1),
           num_recv_tokens_per_expert[E/W] int64, handle: Tensor[]
    ep_combine(y[R,H], handle, group_size, group_name, backend) -> [N,H]   (fp32 sum in rank order, no weights;
        DeepEP across nodes rounds each node's partial sum to bf16 first)
    ep_dispatch_cached(x[N,H], handle, ...) -> [R,H]                     (combine's backward; reuses the layout)
    ep_dispatch_quantized(x, x_q[N,H] fp8, x_scale[N,S] f32, topk_idx, ...) -> recv_x (a gradient carrier, no data),
        recv_x_q[R,H], recv_x_scale[R,S], and the rest as ep_dispatch  (FP8 rows sent; on DeepEP S is 1 or H/128)
    ep_dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle, ...) -> (grad_x, grad_topk_weights)

Every body returns through moepass.ops.fresh_outputs, so the code after an op may view its outputs and modify them
in place, whichever backend made them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.distributed_c10d import _resolve_process_group

from moepass.op_registry import register_exchange

from ..fresh_outputs import fresh_outputs
from . import deepep, reference
from .backend import EPBackend

EP_BACKENDS: dict[str, EPBackend] = {ep.name: ep for ep in (reference.ReferenceEP(), deepep.DeepEP())}


def ep_backend(name: str) -> EPBackend:
    """The implementation an op's `backend` argument names."""
    if name not in EP_BACKENDS:
        raise ValueError(f"EP backend must be one of {tuple(EP_BACKENDS)}; got {name!r}")
    return EP_BACKENDS[name]


def choose_ep_backend(
    group, device, num_experts: int, requested: str = "auto", hidden: int | None = None
) -> tuple[str, str]:
    """Pick the EP implementation for one group: returns (backend, reason) for the report.

    group is a ProcessGroup, a group name, or None (the default group); requested is "auto", "deepep"
    or "reference"; hidden (token width), when known, is checked against DeepEP's limits too.
    Requesting "deepep" where it cannot run raises RuntimeError naming the fix.
    """
    if requested not in ("auto", *EP_BACKENDS):
        raise ValueError(f"EP backend must be one of 'auto', 'deepep', 'reference'; got {requested!r}")
    if requested == "reference":
        return "reference", "the reference backend was requested"
    group = _resolve_process_group(group) if isinstance(group, str) else group
    group_size = dist.get_world_size(group)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    reason = deepep.deepep_unsupported_reason(group_size, torch.device(device), num_experts, hidden, ranks)
    if reason is None:
        return "deepep", deepep.deepep_choice(group_size)
    if requested == "deepep":
        raise RuntimeError(f"EP backend 'deepep' was requested but {reason}; or request the 'reference' backend")
    return "reference", reason


def group_args(group=None) -> tuple[int, str]:
    """(group_size, group_name) as the ops take them, for a ProcessGroup or None (the default group)."""
    group = group if group is not None else dist.group.WORLD
    return group.size(), group.group_name


def _group(group_name: str, group_size: int):
    group = _resolve_process_group(group_name)
    if group.size() != group_size:
        raise ValueError(f"process group {group_name!r} has {group.size()} ranks, the op was built for {group_size}")
    return group


def _check_dispatch_args(x, topk_idx, topk_weights, num_experts, group_size) -> None:
    if x.dim() != 2 or topk_idx.dim() != 2:
        raise ValueError(
            f"ep_dispatch takes x [N, H] and topk_idx [N, K]; got {tuple(x.shape)} and {tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype != torch.int64 or topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_idx must be int64 and topk_weights float32; got {topk_idx.dtype}, {topk_weights.dtype}")
    if num_experts <= 0 or num_experts % group_size:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the {group_size} EP ranks")
    torch._check(topk_idx.shape[0] == x.shape[0], lambda: "topk_idx and x differ in token count")
    torch._check(topk_weights.shape == topk_idx.shape, lambda: "topk_weights and topk_idx differ in shape")


@torch.library.custom_op("moepass::ep_dispatch", mutates_args=())
def ep_dispatch(
    x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int, group_size: int, group_name: str, backend: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    ep = ep_backend(backend)
    _check_dispatch_args(x, topk_idx, topk_weights, num_experts, group_size)
    sent = ep.dispatch(x, topk_idx, topk_weights, num_experts, group_name, _group(group_name, group_size))
    return fresh_outputs(sent, (x, topk_idx, topk_weights))


@ep_dispatch.register_fake
def _ep_dispatch_fake(x, topk_idx, topk_weights, num_experts, group_size, group_name, backend):
    ep = ep_backend(backend)
    _check_dispatch_args(x, topk_idx, topk_weights, num_experts, group_size)
    ep.check_rows(x, group_size, topk_idx.shape[1])  # fail at compile time, not in a kernel
    num_recv = torch.library.get_ctx().new_dynamic_size()
    num_topk = topk_idx.shape[1]
    return (
        x.new_empty((num_recv, x.shape[1])),
        topk_idx.new_empty((num_recv, num_topk)),
        topk_weights.new_empty((num_recv, num_topk)),
        topk_idx.new_empty((num_experts // group_size,)),
        ep.fake_handle(x, num_recv, group_size),
    )


@torch.library.custom_op("moepass::ep_dispatch_quantized", mutates_args=())
def ep_dispatch_quantized(
    x: Tensor, x_q: Tensor, x_scale: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int,
    group_size: int, group_name: str, backend: str
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """ep_dispatch of x's FP8 rows and their scales instead of x (the quantize_once pass): half the bytes sent.

    Returns (recv_x, recv_x_q, recv_x_scale, recv_topk_idx, recv_topk_weights, counts, handle). recv_x is the received
    rows' gradient carrier and holds no data: every reader of it reads (recv_x_q, recv_x_scale) instead
    (moepass::<recipe>_grouped_mm_rows with FP8 rows saved), and its gradient goes back in BF16 as ep_dispatch's."""
    ep = ep_backend(backend)
    _check_quantized_payload(x, x_q, x_scale, ep)
    _check_dispatch_args(x, topk_idx, topk_weights, num_experts, group_size)
    recv_q, recv_scale, recv_idx, recv_w, counts, handle = ep.dispatch_fp8(
        x_q, x_scale, topk_idx, topk_weights, num_experts, group_name, _group(group_name, group_size))
    recv_x = x.new_empty((recv_q.shape[0], x.shape[1]))
    return fresh_outputs((recv_x, recv_q, recv_scale, recv_idx, recv_w, counts, handle),
                         (x, x_q, x_scale, topk_idx, topk_weights))


def _check_quantized_payload(x, x_q, x_scale, ep: EPBackend) -> None:
    ep.check_fp8_scales(x_q, x_scale)
    if tuple(x_q.shape) != tuple(x.shape) or x_q.element_size() != 1:
        raise ValueError(f"ep_dispatch_quantized: x_q must be 1-byte rows shaped like x {tuple(x.shape)}; got "
                         f"{x_q.dtype} {tuple(x_q.shape)}")
    if x_scale.dim() != 2 or x_scale.shape[0] != x.shape[0] or x_scale.dtype != torch.float32:
        raise ValueError(f"ep_dispatch_quantized: x_scale must be float32 [{x.shape[0]}, S]; got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)}")


@ep_dispatch_quantized.register_fake
def _ep_dispatch_quantized_fake(x, x_q, x_scale, topk_idx, topk_weights, num_experts, group_size, group_name,
                                backend):
    ep = ep_backend(backend)
    _check_quantized_payload(x, x_q, x_scale, ep)
    ep.check_fp8_rows(x_q, x_scale, group_size, topk_idx.shape[1])  # fail at compile time, not in a kernel
    recv_x, recv_idx, recv_w, counts, handle = _ep_dispatch_fake(x, topk_idx, topk_weights, num_experts, group_size,
                                                                 group_name, backend)
    num_recv = recv_x.shape[0]
    return (recv_x, x_q.new_empty((num_recv, x_q.shape[1])), x_scale.new_empty((num_recv, x_scale.shape[1])),
            recv_idx, recv_w, counts, handle)


@torch.library.custom_op("moepass::ep_combine", mutates_args=())
def ep_combine(y: Tensor, handle: list[Tensor], group_size: int, group_name: str, backend: str) -> Tensor:
    combined = ep_backend(backend).combine(y, handle, group_name, _group(group_name, group_size))
    return fresh_outputs(combined, (y, handle))


@ep_combine.register_fake
def _ep_combine_fake(y, handle, group_size, group_name, backend):
    num_tokens = handle[ep_backend(backend).size_carriers(group_size)[0]].shape[0]
    return y.new_empty((num_tokens, y.shape[1]))


@torch.library.custom_op("moepass::ep_dispatch_cached", mutates_args=())
def ep_dispatch_cached(x: Tensor, handle: list[Tensor], group_size: int, group_name: str, backend: str) -> Tensor:
    sent = ep_backend(backend).dispatch_cached(x, handle, group_name, _group(group_name, group_size))
    return fresh_outputs(sent, (x, handle))


@ep_dispatch_cached.register_fake
def _ep_dispatch_cached_fake(x, handle, group_size, group_name, backend):
    num_recv = handle[ep_backend(backend).size_carriers(group_size)[1]].shape[0]
    return x.new_empty((num_recv, x.shape[1]))


@torch.library.custom_op("moepass::ep_dispatch_backward", mutates_args=())
def ep_dispatch_backward(
    grad_recv_x: Tensor,
    grad_recv_topk_weights: Tensor,
    handle: list[Tensor],
    group_size: int,
    group_name: str,
    backend: str,
) -> tuple[Tensor, Tensor]:
    grads = ep_backend(backend).dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle, group_name,
                                                  _group(group_name, group_size))
    return fresh_outputs(grads, (grad_recv_x, grad_recv_topk_weights, handle))


@ep_dispatch_backward.register_fake
def _ep_dispatch_backward_fake(grad_recv_x, grad_recv_topk_weights, handle, group_size, group_name, backend):
    num_tokens = handle[ep_backend(backend).size_carriers(group_size)[0]].shape[0]
    return (
        grad_recv_x.new_empty((num_tokens, grad_recv_x.shape[1])),
        grad_recv_topk_weights.new_empty((num_tokens, grad_recv_topk_weights.shape[1])),
    )


def _dispatch_setup_context(ctx, inputs, output):
    x, _, _, _, group_size, group_name, backend = inputs
    recv_topk_idx, handle = output[1], output[4]
    ctx.save_for_backward(recv_topk_idx, *handle)
    ctx.group = (group_size, group_name, backend)
    ctx.hidden, ctx.x_dtype = x.shape[1], x.dtype


def _dispatch_backward(ctx, grad_recv_x, _grad_topk_idx, grad_recv_topk_weights, _grad_counts, _grad_handle):
    grad_x, grad_topk_weights = _dispatch_grads(ctx, grad_recv_x, grad_recv_topk_weights, ctx.needs_input_grad[2])
    return grad_x, None, grad_topk_weights, None, None, None, None


def _dispatch_grads(ctx, grad_recv_x, grad_recv_topk_weights, weights_need_grad: bool):
    """(grad_x, grad_topk_weights or None): the received rows' and weights' gradients sent back, in BF16 / fp32."""
    recv_topk_idx, *handle = ctx.saved_tensors
    if grad_recv_x is None:
        grad_recv_x = recv_topk_idx.new_zeros((recv_topk_idx.shape[0], ctx.hidden), dtype=ctx.x_dtype)
    if not weights_need_grad:
        return ep_combine(grad_recv_x.contiguous(), handle, *ctx.group), None
    if grad_recv_topk_weights is None:
        grad_recv_topk_weights = torch.zeros(recv_topk_idx.shape, dtype=torch.float32, device=recv_topk_idx.device)
    # Forward wrote a constant 0.0 where the expert is not local, so no gradient flows from there.
    grad_recv_topk_weights = torch.where(recv_topk_idx >= 0, grad_recv_topk_weights, 0.0).contiguous()
    return ep_dispatch_backward(grad_recv_x.contiguous(), grad_recv_topk_weights, handle, *ctx.group)


def _dispatch_quantized_setup_context(ctx, inputs, output):
    x, _, _, topk_idx, topk_weights, *rest = inputs
    recv_x, _, _, *recv = output
    _dispatch_setup_context(ctx, (x, topk_idx, topk_weights, *rest), (recv_x, *recv))


def _dispatch_quantized_backward(ctx, grad_recv_x, _grad_q, _grad_scale, _grad_topk_idx, grad_recv_topk_weights,
                                 _grad_counts, _grad_handle):
    grad_x, grad_topk_weights = _dispatch_grads(ctx, grad_recv_x, grad_recv_topk_weights, ctx.needs_input_grad[4])
    return grad_x, None, None, None, grad_topk_weights, None, None, None, None


def _save_handle(ctx, inputs, output):
    _, handle, group_size, group_name, backend = inputs
    ctx.save_for_backward(*handle)
    ctx.group = (group_size, group_name, backend)


def _combine_backward(ctx, grad):
    handle = list(ctx.saved_tensors)
    return ep_dispatch_cached(grad.contiguous(), handle, *ctx.group), [None] * len(handle), None, None, None


def _dispatch_cached_backward(ctx, grad):
    handle = list(ctx.saved_tensors)
    return ep_combine(grad.contiguous(), handle, *ctx.group), [None] * len(handle), None, None, None


for _exchange in (ep_dispatch, ep_dispatch_quantized, ep_combine, ep_dispatch_cached,
                  ep_dispatch_backward):  # never recomputed under AC
    register_exchange(_exchange._opoverload, dispatch=_exchange is ep_dispatch)

ep_dispatch.register_autograd(_dispatch_backward, setup_context=_dispatch_setup_context)
ep_dispatch_quantized.register_autograd(_dispatch_quantized_backward, setup_context=_dispatch_quantized_setup_context)
ep_combine.register_autograd(_combine_backward, setup_context=_save_handle)
ep_dispatch_cached.register_autograd(_dispatch_cached_backward, setup_context=_save_handle)
