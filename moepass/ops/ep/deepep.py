"""Expert-parallel dispatch/combine on DeepEP V1 normal-mode intranode kernels (``deep_ep.Buffer``).

DeepEP is optional and never vendored: everything here imports it lazily. The API used is the V1
``Buffer`` of deepseek-ai/DeepEP 1.2.x (commit 567632d), also kept as ``deep_ep.Buffer`` (legacy) in 2.x.

Handle = DeepEP's intranode handle tuple, kept as a list of tensors so it fits a custom-op schema:
    [0] rank_prefix_matrix          int32 [W, W]
    [1] channel_prefix_matrix       int32 [W, C]     C = Buffer.num_sms // 2 channels
    [2] recv_channel_prefix_matrix  int32 [W, C]
    [3] recv_src_idx                int32 [R]
    [4] is_token_in_rank            bool  [N, W]
    [5] send_head                   int32 [N, W]
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os

import torch

SUPPORTED_GROUP_SIZES = (2, 4, 8)
MAX_LOCAL_EXPERTS = 1024  # DeepEP's NUM_MAX_LOCAL_EXPERTS
MAX_BF16_HIDDEN = 8176  # intranode dispatch stages half a row, plus an 8-byte mbarrier, in 8 KiB of shared memory
INSTALL_HINT = "build and install it from a source checkout of https://github.com/deepseek-ai/DeepEP"
HANDLE_RECV_SRC_IDX = 3
HANDLE_IS_TOKEN_IN_RANK = 4

# One Buffer per process group (keyed by group name), reused by every layer; grown, never shrunk.
_buffers: dict[str, object] = {}


@functools.lru_cache(maxsize=None)
def _import_deep_ep():
    """Return (deep_ep module, None), or (None, why it cannot be used)."""
    if importlib.util.find_spec("deep_ep") is None:
        return None, f"deep_ep is not installed ({INSTALL_HINT})"
    try:
        import deep_ep
    except Exception as error:  # a build against other CUDA/NCCL libraries fails here, not at find_spec
        return None, f"deep_ep is installed but fails to import ({type(error).__name__}: {error})"
    used = ("get_dispatch_layout", "dispatch", "combine", "get_dispatch_config", "get_combine_config")
    missing = [name for name in used if not hasattr(deep_ep.Buffer, name)]
    if missing:
        return None, f"deep_ep.Buffer lacks the V1 normal-mode API ({', '.join(missing)}); install DeepEP 1.2.x"
    if "explicitly_destroy" not in inspect.signature(deep_ep.Buffer.__init__).parameters:
        return None, "deep_ep is older than 1.2 (Buffer has no explicitly_destroy); install DeepEP 1.2.x"
    return deep_ep, None


def deep_ep_module():
    deep_ep, reason = _import_deep_ep()
    if deep_ep is None:
        raise RuntimeError(f"the 'deepep' EP backend cannot run: {reason}")
    return deep_ep


def deep_ep_version() -> str:
    deep_ep = deep_ep_module()
    version = getattr(deep_ep, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("deep_ep")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown version"
    return version


def hidden_unsupported_reason(hidden: int) -> str | None:
    if hidden % 16:
        return f"hidden={hidden} is not a multiple of 16 (DeepEP copies half rows in 16-byte units)"
    if hidden > MAX_BF16_HIDDEN:
        return f"hidden={hidden} exceeds DeepEP's intranode limit of {MAX_BF16_HIDDEN} bf16 values"
    return None


def deepep_unsupported_reason(
    group_size: int, device: torch.device, num_experts: int, hidden: int | None = None
) -> str | None:
    """Why DeepEP cannot serve this EP group, or None when it can."""
    if device.type != "cuda":
        return f"tensors are on {device.type}; DeepEP needs CUDA GPUs"
    _, reason = _import_deep_ep()
    if reason is not None:
        return reason
    if group_size not in SUPPORTED_GROUP_SIZES:
        return f"the EP group has {group_size} ranks; DeepEP intranode supports 2, 4 or 8"
    if num_experts % group_size:
        return f"num_experts={num_experts} is not a multiple of the {group_size} EP ranks"
    if num_experts // group_size > MAX_LOCAL_EXPERTS:
        return f"{num_experts // group_size} experts per rank exceeds DeepEP's limit of {MAX_LOCAL_EXPERTS}"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    if group_size > min(local_ranks, torch.cuda.device_count()):
        return f"the EP group ({group_size} ranks) spans more than one node; only intranode DeepEP is wired up"
    if "PCIE" in torch.cuda.get_device_name(device).upper() and group_size > 2:
        return "PCIe GPUs have at most pairwise NVLink; DeepEP intranode needs all ranks on NVLink"
    return hidden_unsupported_reason(hidden) if hidden is not None else None


def _hidden_bytes(x: torch.Tensor) -> int:
    # As DeepEP's README sizes it: FP8 tokens still need room for BF16 combine.
    return x.shape[1] * max(x.element_size(), 2)


def _buffer(group_name: str, group, hidden_bytes: int):
    deep_ep = deep_ep_module()
    world = group.size()
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, world))
        num_rdma_bytes = max(num_rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, world))
    buffer = _buffers.get(group_name)
    if buffer is None or buffer.num_nvl_bytes < num_nvl_bytes or buffer.num_rdma_bytes < num_rdma_bytes:
        if buffer is not None:
            # destroy() is a barrier over the group; every rank grows at the same collective call.
            buffer.destroy()
        # explicitly_destroy: a destructor-time barrier at garbage collection could hang one rank.
        buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
        _buffers[group_name] = buffer
    return buffer


def release_deepep_buffers() -> None:
    """Free every DeepEP buffer (collective: call on all ranks, before destroy_process_group)."""
    for buffer in _buffers.values():
        buffer.destroy()
    _buffers.clear()


def deepep_dispatch(x, topk_idx, topk_weights, num_experts: int, group_name: str, group):
    deep_ep = deep_ep_module()
    check_tokens(x, "dispatch")
    buffer = _buffer(group_name, group, _hidden_bytes(x))
    topk_idx = topk_idx.to(deep_ep.topk_idx_t).contiguous()
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = layout
    recv_x, recv_topk_idx, recv_topk_weights, recv_counts, handle, _ = buffer.dispatch(
        x.contiguous(),
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights.contiguous(),
    )
    num_recv_tokens_per_expert = torch.tensor(recv_counts, dtype=torch.int64, device=x.device)
    return recv_x, recv_topk_idx.to(torch.int64), recv_topk_weights, num_recv_tokens_per_expert, list(handle)


def deepep_combine(y, handle, group_name: str, group):
    check_tokens(y, "combine")
    combined, _, _ = _buffer(group_name, group, _hidden_bytes(y)).combine(y.contiguous(), tuple(handle))
    return combined


def deepep_dispatch_cached(x, handle, group_name: str, group):
    check_tokens(x, "dispatch")
    recv_x, *_ = _buffer(group_name, group, _hidden_bytes(x)).dispatch(x.contiguous(), handle=tuple(handle))
    return recv_x


def deepep_dispatch_backward(grad_recv_x, grad_recv_topk_weights, handle, group_name: str, group):
    check_tokens(grad_recv_x, "combine")
    buffer = _buffer(group_name, group, _hidden_bytes(grad_recv_x))
    grad_x, grad_topk_weights, _ = buffer.combine(
        grad_recv_x.contiguous(), tuple(handle), topk_weights=grad_recv_topk_weights.contiguous()
    )
    return grad_x, grad_topk_weights


def deepep_fake_handle(x: torch.Tensor, num_recv, group_size: int) -> list[torch.Tensor]:
    num_channels = deep_ep_module().Buffer.num_sms // 2
    num_tokens = x.shape[0]
    int32 = dict(dtype=torch.int32)
    return [
        x.new_empty((group_size, group_size), **int32),
        x.new_empty((group_size, num_channels), **int32),
        x.new_empty((group_size, num_channels), **int32),
        x.new_empty((num_recv,), **int32),
        x.new_empty((num_tokens, group_size), dtype=torch.bool),
        x.new_empty((num_tokens, group_size), **int32),
    ]


def check_tokens(x: torch.Tensor, what: str) -> None:
    # Checked on the host: DeepEP's own checks are device-side traps.
    if x.dtype != torch.bfloat16:
        raise TypeError(f"DeepEP {what} takes bfloat16 tokens, got {x.dtype}; use the 'reference' EP backend")
    reason = hidden_unsupported_reason(x.shape[1])
    if reason is not None:
        raise ValueError(f"{reason}; use the 'reference' EP backend")
