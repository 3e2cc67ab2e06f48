"""Expert-parallel dispatch/combine on DeepEP V1 normal-mode kernels (``deep_ep.Buffer``), within a node and across.

DeepEP is optional and never vendored: everything here imports it lazily. The API used is the V1 ``Buffer`` of
deepseek-ai/DeepEP 1.2.x (commit 567632d), also kept as ``deep_ep.Buffer`` (legacy) in 2.x.

A group of 2, 4 or 8 ranks runs DeepEP's intranode kernels (NVLink); a group of 16 to 160 ranks, 8 on each node,
its internode kernels (NVLink within a node, RDMA between the nodes' GPUs of one index, through NVSHMEM).
``Buffer.dispatch`` picks them by the group size (more than 8 ranks: internode), and so does the handle, kept as a
list of tensors so that it fits a custom-op schema (C = Buffer.num_sms // 2 channels, R rows received,
R_rdma rows this GPU receives over RDMA):

    intranode (W <= 8)                               internode (W = 8 x nodes)
    [0] rank_prefix_matrix         int32 [W, W]      [0] is_token_in_rank                bool  [N, W]
    [1] channel_prefix_matrix      int32 [W, C]      [1] rdma_channel_prefix_matrix      int32 [nodes, C]
    [2] recv_channel_prefix_matrix int32 [W, C]      [2] gbl_channel_prefix_matrix       int32 [W, C]
    [3] recv_src_idx               int32 [R]         [3] recv_rdma_channel_prefix_matrix int32 [nodes, C]
    [4] is_token_in_rank           bool  [N, W]      [4] recv_rdma_rank_prefix_sum       int32 [nodes]
    [5] send_head                  int32 [N, W]      [5] recv_gbl_channel_prefix_matrix  int32 [W, C]
                                                     [6] recv_gbl_rank_prefix_sum        int32 [W]
                                                     [7] recv_src_meta                   uint8 [R, 8]
                                                     [8] send_rdma_head                  int32 [N, nodes]
                                                     [9] send_nvl_head                   int32 [R_rdma, 8]

Combine rewrites the head tensors in place (idempotently): nothing else reads them.
FP8 dispatch sends (e4m3 [N, H], fp32 [N, H/128]) as DeepEP takes them; combine and every gradient stay BF16.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import os

import torch

from .backend import EPBackend

NVL_PEERS = 8  # DeepEP's NUM_MAX_NVL_PEERS: a node's NVLink domain; a larger group spans nodes of 8
INTRANODE_GROUP_SIZES = (2, 4, 8)
INTERNODE_NODE_COUNTS = (2, 3, 4, 6, 8, 12, 16, 18, 20)  # the node counts DeepEP's internode kernels are built for
MAX_LOCAL_EXPERTS = 1024  # DeepEP's NUM_MAX_LOCAL_EXPERTS
MAX_BF16_HIDDEN = 8176  # intranode dispatch stages half a row, plus an 8-byte mbarrier, in 8 KiB of shared memory
INTERNODE_TOKEN_BYTES = 16376  # internode dispatch stages a token (row, source meta, scales, top-k) + 8 bytes in 16 KiB
FP8_SCALE_BLOCK = 128  # DeepEP's FP8 rows carry one fp32 scale per 128 columns
INSTALL_HINT = "build and install it from a source checkout of https://github.com/deepseek-ai/DeepEP"
NVSHMEM_HINT = ("rebuild DeepEP with NVSHMEM (NVSHMEM_DIR, or the nvidia-nvshmem wheel installed, before "
                "`pip install .`)")
# The device types DeepEP's kernels run on. Tests add "cpu" to run this module on a CPU double of deep_ep.
DEVICE_TYPES = ("cuda",)

INTRANODE_HANDLE = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                    "is_token_in_rank", "send_head")
INTERNODE_HANDLE = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                    "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
                    "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
HANDLE_RECV_SRC_IDX = INTRANODE_HANDLE.index("recv_src_idx")
HANDLE_IS_TOKEN_IN_RANK = INTRANODE_HANDLE.index("is_token_in_rank")

# One Buffer per process group (keyed by group name), reused by every layer; grown, never shrunk.
_buffers: dict[str, object] = {}


def is_internode(group_size: int) -> bool:
    return group_size > NVL_PEERS


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


def nvshmem_missing_reason() -> str | None:
    """Why this deep_ep cannot run internode kernels, or None. A build without NVSHMEM refuses every RDMA size hint
    (csrc/config.hpp get_rdma_buffer_size_hint: "NVSHMEM is disable during compilation"): asked on the host for a
    16-rank group, with no side effect."""
    deep_ep = deep_ep_module()
    try:
        deep_ep.Buffer.get_dispatch_config(2 * NVL_PEERS).get_rdma_buffer_size_hint(2 * 4096, 2 * NVL_PEERS)
    except Exception as error:
        return f"deep_ep was built without NVSHMEM ({type(error).__name__}: {str(error).strip()}); {NVSHMEM_HINT}"
    return None


def hidden_unsupported_reason(hidden: int, group_size: int = 2, num_topk: int = 0) -> str | None:
    """Why DeepEP's kernels cannot move BF16 rows of this width over a group of this size, or None."""
    if hidden % 16:
        return f"hidden={hidden} is not a multiple of 16 (DeepEP copies half rows in 16-byte units)"
    if not is_internode(group_size):
        if hidden > MAX_BF16_HIDDEN:
            return f"hidden={hidden} exceeds DeepEP's intranode limit of {MAX_BF16_HIDDEN} bf16 values"
        return None
    if hidden % 256:
        return f"hidden={hidden} is not a multiple of 256 (DeepEP's internode combine moves rows in 512-byte units)"
    token_bytes = internode_token_bytes(2 * hidden, 0, num_topk)
    if token_bytes > INTERNODE_TOKEN_BYTES:
        return (f"hidden={hidden} with top-{num_topk} makes {token_bytes}-byte tokens, over DeepEP's internode limit "
                f"of {INTERNODE_TOKEN_BYTES}")
    return None


def internode_token_bytes(row_bytes: int, num_scales: int, num_topk: int) -> int:
    """A token in DeepEP's internode queues: the row, its 8-byte source meta, scales, int32 ids and fp32 weights."""
    return -(-(row_bytes + 8 + 4 * num_scales + 8 * num_topk) // 16) * 16


def fp8_scales_unsupported_reason(hidden: int, scale_columns: int, scale_dtype=torch.float32) -> str | None:
    """Why FP8 rows with `scale_columns` fp32 scales a row cannot go through DeepEP's FP8 dispatch, which takes one
    fp32 scale per 128 columns ([N, H/128]): blockwise's 1x128 tiles are that; one scale a row (fp8_rowwise) is that,
    repeated; other blocks (MXFP8's 1x32 power-of-two scales) are not."""
    if hidden % FP8_SCALE_BLOCK:
        return f"hidden={hidden} is not a multiple of {FP8_SCALE_BLOCK} (DeepEP sends one scale per 128 columns)"
    if scale_dtype != torch.float32:
        return f"the scales are {scale_dtype}; DeepEP sends float32 scales, one per 128 columns"
    if scale_columns not in (1, hidden // FP8_SCALE_BLOCK):
        block = f"1x{hidden // scale_columns}" if scale_columns and hidden % scale_columns == 0 else \
            f"{scale_columns} a row"
        return (f"the rows' scales are {block} blocks; DeepEP sends one fp32 scale per 128 columns (blockwise's 1x128 "
                "tiles, or one scale a row repeated)")
    return None


def _ranks_per_node(device: torch.device) -> int:
    """LOCAL_WORLD_SIZE (torchrun sets it), at most the GPUs visible; without it the visible GPUs (CPU ranks: all)."""
    import torch.distributed as dist

    visible = torch.cuda.device_count() if device.type == "cuda" else None
    default = visible if visible is not None else (dist.get_world_size() if dist.is_initialized() else 1)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", default))
    return local if visible is None else min(local, visible)


def _node_layout_reason(group_size: int, device: torch.device, group_ranks: list[int] | None) -> str | None:
    """Why the group's ranks are not laid out as DeepEP needs: within one node intranode; across nodes, 8 consecutive
    group ranks per node (DeepEP's node of a rank is rank // 8). Nodes are read from LOCAL_WORLD_SIZE (torchrun's
    global rank = node * LOCAL_WORLD_SIZE + local rank)."""
    per_node = _ranks_per_node(device)
    nodes = None if group_ranks is None else [r // per_node for r in group_ranks]
    if not is_internode(group_size):
        if group_size > per_node or (nodes is not None and len(set(nodes)) > 1):
            return (f"the EP group ({group_size} ranks) spans more than one node ({per_node} ranks per node); DeepEP "
                    f"runs a group that spans nodes only with 8 ranks on each, in groups of 16 to 160 ranks")
        return None
    if per_node != NVL_PEERS:
        return (f"the EP group ({group_size} ranks) spans nodes, and DeepEP's internode mode needs 8 ranks of it on "
                f"each node; this job has {per_node} ranks per node (LOCAL_WORLD_SIZE)")
    if nodes is not None:
        blocks = [nodes[i:i + NVL_PEERS] for i in range(0, group_size, NVL_PEERS)]
        if any(len(set(block)) != 1 for block in blocks) or len({block[0] for block in blocks}) != len(blocks):
            return ("the EP group's ranks are not 8 consecutive ranks per node (DeepEP takes group rank // 8 as the "
                    "node); build the EP group from whole nodes")
    return None


def deepep_unsupported_reason(group_size: int, device: torch.device, num_experts: int, hidden: int | None = None,
                              group_ranks: list[int] | None = None) -> str | None:
    """Why DeepEP cannot serve this EP group, or None when it can. group_ranks: the group's global ranks, when known,
    to check that it sits on nodes the way DeepEP needs."""
    if device.type not in DEVICE_TYPES:
        return f"tensors are on {device.type}; DeepEP needs CUDA GPUs"
    _, reason = _import_deep_ep()
    if reason is not None:
        return reason
    if num_experts % group_size:
        return f"num_experts={num_experts} is not a multiple of the {group_size} EP ranks"
    if num_experts // group_size > MAX_LOCAL_EXPERTS:
        return f"{num_experts // group_size} experts per rank exceeds DeepEP's limit of {MAX_LOCAL_EXPERTS}"
    if is_internode(group_size):
        if group_size % NVL_PEERS or group_size // NVL_PEERS not in INTERNODE_NODE_COUNTS:
            counts = ", ".join(str(NVL_PEERS * n) for n in INTERNODE_NODE_COUNTS)
            return f"the EP group has {group_size} ranks; DeepEP across nodes supports {counts}"
        reason = _node_layout_reason(group_size, device, group_ranks)
        if reason is not None:
            return reason
        missing = nvshmem_missing_reason()
        if missing is not None:
            return (f"the EP group ({group_size} ranks) spans {group_size // NVL_PEERS} nodes, which takes DeepEP's "
                    f"internode kernels, and {missing}")
    else:
        if group_size not in INTRANODE_GROUP_SIZES:
            return f"the EP group has {group_size} ranks; DeepEP within a node supports 2, 4 or 8"
        reason = _node_layout_reason(group_size, device, group_ranks)
        if reason is not None:
            return reason
        if device.type == "cuda" and "PCIE" in torch.cuda.get_device_name(device).upper() and group_size > 2:
            return "PCIe GPUs have at most pairwise NVLink; DeepEP intranode needs all ranks on NVLink"
    return hidden_unsupported_reason(hidden, group_size) if hidden is not None else None


def deepep_choice(group_size: int) -> str:
    """What the report says when DeepEP serves a group of this size."""
    if is_internode(group_size):
        return (f"deep_ep {deep_ep_version()} importable with NVSHMEM, {group_size} ranks as {group_size // NVL_PEERS} "
                "nodes of 8 (internode: NVLink within a node, RDMA between nodes; the RDMA network is first used "
                "when the buffer is built)")
    return f"deep_ep {deep_ep_version()} importable, {group_size} ranks on NVLink (intranode)"


def _hidden_bytes(x: torch.Tensor) -> int:
    # As DeepEP's README sizes it: FP8 tokens still need room for BF16 combine.
    return x.shape[1] * max(x.element_size(), 2)


def _buffer(group_name: str, group, hidden_bytes: int):
    deep_ep = deep_ep_module()
    world = group.size()
    num_nvl_bytes = num_rdma_bytes = 0
    for config in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)):
        num_nvl_bytes = max(num_nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, world))
        if is_internode(world):  # 0 within a node; a build without NVSHMEM refuses to answer at all
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


def _dispatch(payload, topk_idx, topk_weights, num_experts: int, group_name: str, group):
    """Buffer.dispatch of `payload` (bf16 rows, or the (e4m3 rows, fp32 scales) tuple) with a new layout."""
    deep_ep = deep_ep_module()
    rows = payload[0] if isinstance(payload, tuple) else payload
    buffer = _buffer(group_name, group, _hidden_bytes(rows))
    topk_idx = topk_idx.to(deep_ep.topk_idx_t).contiguous()
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, _ = layout
    recv, recv_topk_idx, recv_topk_weights, recv_counts, handle, _ = buffer.dispatch(
        payload,
        num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
        is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights.contiguous(),
    )
    num_recv_tokens_per_expert = torch.tensor(recv_counts, dtype=torch.int64, device=rows.device)
    return recv, recv_topk_idx.to(torch.int64), recv_topk_weights, num_recv_tokens_per_expert, list(handle)


class DeepEP(EPBackend):
    name = "deepep"

    def size_carriers(self, group_size: int) -> tuple[int, int]:
        if is_internode(group_size):
            return INTERNODE_HANDLE.index("is_token_in_rank"), INTERNODE_HANDLE.index("recv_src_meta")
        return HANDLE_IS_TOKEN_IN_RANK, HANDLE_RECV_SRC_IDX

    def fake_handle(self, x: torch.Tensor, num_recv, group_size: int) -> list[torch.Tensor]:
        """Internode also has R_rdma, a size of its own."""
        channels = deep_ep_module().Buffer.num_sms // 2
        n, w = x.shape[0], group_size
        int32 = dict(dtype=torch.int32)
        if not is_internode(group_size):
            return [x.new_empty((w, w), **int32), x.new_empty((w, channels), **int32),
                    x.new_empty((w, channels), **int32), x.new_empty((num_recv,), **int32),
                    x.new_empty((n, w), dtype=torch.bool), x.new_empty((n, w), **int32)]
        nodes = w // NVL_PEERS
        num_rdma_recv = torch.library.get_ctx().new_dynamic_size()
        return [x.new_empty((n, w), dtype=torch.bool), x.new_empty((nodes, channels), **int32),
                x.new_empty((w, channels), **int32), x.new_empty((nodes, channels), **int32),
                x.new_empty((nodes,), **int32), x.new_empty((w, channels), **int32), x.new_empty((w,), **int32),
                x.new_empty((num_recv, 8), dtype=torch.uint8), x.new_empty((n, nodes), **int32),
                x.new_empty((num_rdma_recv, NVL_PEERS), **int32)]

    def check_rows(self, x: torch.Tensor, group_size: int, num_topk: int) -> None:
        check_tokens(x, "dispatch", group_size, num_topk)

    def check_fp8_scales(self, x_q: torch.Tensor, x_scale: torch.Tensor) -> None:
        reason = fp8_scales_unsupported_reason(x_q.shape[1], x_scale.shape[1], x_scale.dtype)
        if reason is not None:
            raise ValueError(f"ep_dispatch_quantized on DeepEP: {reason}; use moepass::ep_dispatch")

    def check_fp8_rows(self, x_q: torch.Tensor, x_scale: torch.Tensor, group_size: int, num_topk: int) -> None:
        check_fp8_tokens(x_q, x_scale, group_size, num_topk)

    def dispatch(self, x, topk_idx, topk_weights, num_experts: int, group_name: str, group):
        check_tokens(x, "dispatch", group.size(), topk_idx.shape[1])
        return _dispatch(x.contiguous(), topk_idx, topk_weights, num_experts, group_name, group)

    def dispatch_fp8(self, x_q, x_scale, topk_idx, topk_weights, num_experts: int, group_name: str, group):
        """FP8 rows and their scales through DeepEP's FP8 dispatch. One scale a row travels repeated per 128 columns
        (exact) and comes back as one."""
        check_fp8_tokens(x_q, x_scale, group.size(), topk_idx.shape[1])
        blocks = x_q.shape[1] // FP8_SCALE_BLOCK
        scales = x_scale.expand(-1, blocks) if x_scale.shape[1] == 1 else x_scale
        recv, recv_idx, recv_w, counts, handle = _dispatch((x_q.contiguous(), scales.contiguous()), topk_idx,
                                                           topk_weights, num_experts, group_name, group)
        recv_q, recv_scale = recv
        if x_scale.shape[1] == 1:
            recv_scale = recv_scale[:, :1].contiguous()
        return recv_q, recv_scale, recv_idx, recv_w, counts, handle

    def combine(self, y, handle, group_name: str, group):
        check_tokens(y, "combine", group.size())
        combined, _, _ = _buffer(group_name, group, _hidden_bytes(y)).combine(y.contiguous(), tuple(handle))
        return combined

    def dispatch_cached(self, x, handle, group_name: str, group):
        check_tokens(x, "dispatch", group.size())
        recv_x, *_ = _buffer(group_name, group, _hidden_bytes(x)).dispatch(x.contiguous(), handle=tuple(handle))
        return recv_x

    def dispatch_backward(self, grad_recv_x, grad_recv_topk_weights, handle, group_name: str, group):
        check_tokens(grad_recv_x, "combine", group.size(), grad_recv_topk_weights.shape[1])
        buffer = _buffer(group_name, group, _hidden_bytes(grad_recv_x))
        grad_x, grad_topk_weights, _ = buffer.combine(
            grad_recv_x.contiguous(), tuple(handle), topk_weights=grad_recv_topk_weights.contiguous()
        )
        return grad_x, grad_topk_weights


def check_tokens(x: torch.Tensor, what: str, group_size: int = 2, num_topk: int = 0) -> None:
    # Checked on the host: DeepEP's own checks are device-side traps.
    if x.dtype != torch.bfloat16:
        raise TypeError(f"DeepEP {what} takes bfloat16 tokens, got {x.dtype}; use the 'reference' EP backend")
    reason = hidden_unsupported_reason(x.shape[1], group_size, num_topk)
    if reason is not None:
        raise ValueError(f"{reason}; use the 'reference' EP backend")


def check_fp8_tokens(x_q: torch.Tensor, x_scale: torch.Tensor, group_size: int = 2, num_topk: int = 0) -> None:
    """FP8 rows DeepEP can send: e4m3 [N, H], fp32 scales one a row or one per 128 columns; the combine and the
    gradients of the same rows go back in BF16, so the BF16 width limits hold too."""
    if x_q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"DeepEP's FP8 dispatch takes float8_e4m3fn rows, got {x_q.dtype}")
    reason = fp8_scales_unsupported_reason(x_q.shape[1], x_scale.shape[1], x_scale.dtype) \
        or hidden_unsupported_reason(x_q.shape[1], group_size, num_topk)
    if reason is not None:
        raise ValueError(f"{reason}; use the 'reference' EP backend")
