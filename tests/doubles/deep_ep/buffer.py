"""deep_ep.Buffer (DeepEP V1 normal mode) over torch.distributed: the double's communication and checks.

Every claim cites deepseek-ai/DeepEP@567632d: deep_ep/buffer.py (the Python API and its docstrings), csrc/deep_ep.cpp
(host checks), csrc/kernels/*.cu (what the kernels write). Where the layout of rows and handles comes from, see
layout.py. The double gathers every rank's routing (is_token_in_rank) and moves rows with one all_to_all_single of
bytes, so it runs on gloo (CPU tensors) and on NCCL (CUDA tensors) alike.

Not modelled: low-latency mode, num_worst_tokens, bias in combine, async events and streams (every call finishes
before it returns, as DeepEP's does with async_finish=False), the RDMA network itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import layout
from .config import (
    COMBINE_CHUNKS, DISPATCH_CHUNKS, NUM_MAX_LOCAL_EXPERTS, NUM_MAX_NVL_PEERS, NUM_MAX_RDMA_PEERS, Config,
    host_assert,
)
from . import config as _config

TOPK_IDX_T = torch.int64  # deep_ep.topk_idx_t, "typically torch.int64" (buffer.py get_dispatch_layout L302)
INTRANODE_SMEM_PER_WARP = 8192  # intranode.cu L563 kNumTMABytesPerWarp of dispatch
INTERNODE_SMEM_PER_WARP = 16384  # internode.cu L1249 kNumTMABytesPerWarp of dispatch


class DeepEPDeviceTrap(RuntimeError):
    """A condition DeepEP checks on the device with EP_DEVICE_ASSERT (a trap that kills the CUDA context)."""


class EventOverlap:
    """deep_ep.EventOverlap (utils.py L9): every double call has finished on return, so waiting is a no-op."""

    def __init__(self, event=None, extra_tensors=None):
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _align_up(a: int, b: int) -> int:
    return (a + b - 1) // b * b


def _bytes_per_token(hidden_int4: int, num_scales: int, num_topk: int) -> int:
    """internode.cu L42-46 get_num_bytes_per_token (ids sent as int32 in the queues)."""
    return _align_up(hidden_int4 * 16 + _config.SOURCE_META_BYTES + num_scales * 4 + num_topk * 4 + num_topk * 4, 16)


class Buffer:
    """DeepEP V1's communication buffer (buffer.py L13). Normal mode only."""

    num_sms: int = 20  # buffer.py L30

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None):
        """buffer.py L32-136 (collective over the group); the checks of csrc/deep_ep.cpp L152-168."""
        if group is None:
            raise ValueError("Either 'group' or 'comm' must be provided.")  # buffer.py L89 (mpi4py comm: not modelled)
        if low_latency_mode:
            raise NotImplementedError("the deep_ep double models normal mode only")
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        world = self.group_size
        host_assert(num_nvl_bytes % 128 == 0 and num_nvl_bytes <= 2**31 - 1, "num_nvl_bytes % 128 == 0")
        host_assert(num_rdma_bytes % 128 == 0 and num_rdma_bytes <= 2**31 - 1, "num_rdma_bytes % 128 == 0")
        host_assert(world <= NUM_MAX_NVL_PEERS * NUM_MAX_RDMA_PEERS, "num_ranks <= 160")
        host_assert(world < NUM_MAX_NVL_PEERS or world % NUM_MAX_NVL_PEERS == 0, "num_ranks % 8 == 0")
        if num_rdma_bytes > 0:  # deep_ep.cpp L160-161: an RDMA buffer only across nodes (or in low-latency mode)
            host_assert(world > NUM_MAX_NVL_PEERS, "num_ranks > NUM_MAX_NVL_PEERS or low_latency_mode")
        self.num_rdma_ranks = max(1, world // NUM_MAX_NVL_PEERS)  # deep_ep.cpp L165-166
        if not _config.NVSHMEM:  # deep_ep.cpp L167-168
            host_assert(self.num_rdma_ranks == 1, 'num_rdma_ranks == 1 and "NVSHMEM is disabled during compilation"')
        dist.barrier(group=group)  # the constructor all-gathers device ids and IPC handles (buffer.py L96-134)
        self.runtime = "available"

    def destroy(self) -> None:
        """buffer.py L138-147; the runtime's destroy is a barrier over the node's ranks (deep_ep.cpp L279-300)."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert self.runtime is not None, "destroyed twice"
        dist.barrier(group=self.group)
        self.runtime = None

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """buffer.py L154-163."""
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """buffer.py L233-260: a table per group size; others are refused."""
        assert num_ranks in DISPATCH_CHUNKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *DISPATCH_CHUNKS[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """buffer.py L263-290."""
        assert num_ranks in COMBINE_CHUNKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *COMBINE_CHUNKS[num_ranks])

    # ------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event=None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """buffer.py L293-320 (computed by layout.cu L10-113): (num_tokens_per_rank, num_tokens_per_rdma_rank or None
        within a node, num_tokens_per_expert, is_token_in_rank, event)."""
        self._check_available()
        host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "topk_idx.dim() == 2 and contiguous")
        host_assert(topk_idx.dtype == TOPK_IDX_T, "topk_idx.scalar_type() == topk_idx_t")
        host_assert(num_experts > 0 and num_experts % self.group_size == 0, "num_experts % num_ranks == 0")
        out = layout.dispatch_layout(topk_idx, num_experts, self.group_size)
        per_rank, per_rdma, per_expert, is_token_in_rank = (t if t is None else t.to(topk_idx.device) for t in out)
        return per_rank, per_rdma, per_expert, is_token_in_rank, EventOverlap()

    # ------------------------------------------------------------ dispatch

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment: int = 1,
                 num_worst_tokens: int = 0, config=None, previous_event=None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """buffer.py L322-403. x: bf16 [N, H], or (e4m3 [N, H], fp32 [N, H // 128]) (its docstring, L340-342).
        Returns (recv_x (a tuple for FP8), recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
        event); with `handle` (cached mode) only recv_x, the rest None (L383-390). Intranode handle: 6 tensors;
        across nodes (num_rdma_ranks > 1, L376-379) the internode handle: 10 tensors."""
        self._check_available()
        config = self.get_dispatch_config(self.group_size) if config is None else config
        if num_worst_tokens:
            raise NotImplementedError("the deep_ep double does not model num_worst_tokens")
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        self._check_tokens(x, x_scales)
        internode = self.num_rdma_ranks > 1
        channels = config.num_sms // 2
        host_assert(config.num_sms % 2 == 0, "config.num_sms % 2 == 0")
        if handle is not None:
            assert topk_idx is None and topk_weights is None  # buffer.py L384 / L472
            is_token_in_rank = handle[0] if internode else handle[4]
            rows_per_source = (layout.internode_rows_per_source(handle) if internode
                               else layout.intranode_rows_per_source(handle, self.rank))
            self._check_room(config, x, x_scales, 0, internode, dispatch=True)
            recv = self._exchange(x, x_scales, None, None, is_token_in_rank, rows_per_source)
            recv_x = (recv["x"], recv["scales"]) if x_scales is not None else recv["x"]
            return recv_x, None, None, None, None, EventOverlap()

        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        host_assert(num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32,
                    "num_tokens_per_rank / num_tokens_per_expert are int32")
        host_assert(is_token_in_rank.dtype == torch.bool and is_token_in_rank.is_contiguous()
                    and tuple(is_token_in_rank.shape) == (x.shape[0], self.group_size),
                    "is_token_in_rank bool [num_tokens, num_ranks]")
        num_experts = num_tokens_per_expert.shape[0]
        host_assert(num_experts % self.group_size == 0 and num_experts // self.group_size <= NUM_MAX_LOCAL_EXPERTS,
                    "num_experts % num_ranks == 0 and local experts <= NUM_MAX_LOCAL_EXPERTS")
        if internode:  # deep_ep.cpp L966 / L1001
            host_assert(num_tokens_per_rdma_rank is not None
                        and num_tokens_per_rdma_rank.shape[0] == self.num_rdma_ranks,
                        "num_tokens_per_rdma_rank [num_rdma_ranks]")
        num_topk = 0
        host_assert((topk_idx is None) == (topk_weights is None), "topk_idx.has_value() == topk_weights.has_value()")
        if topk_idx is not None:
            num_topk = topk_idx.shape[1]
            host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.shape[0] == x.shape[0],
                        "topk_idx [num_tokens, num_topk] contiguous")
            host_assert(topk_weights.dtype == torch.float32 and tuple(topk_weights.shape) == tuple(topk_idx.shape)
                        and topk_weights.is_contiguous(), "topk_weights float [num_tokens, num_topk] contiguous")
        self._check_room(config, x, x_scales, num_topk, internode, dispatch=True, num_experts=num_experts)

        masks = self._all_gather_rows(is_token_in_rank.to(torch.uint8))
        masks = [m.bool().cpu() for m in masks]
        build = layout.internode_handle if internode else layout.intranode_handle
        handle = tuple(t.to(x.device) for t in build(masks, self.rank, channels))
        rows_per_source = [int(m[:, self.rank].sum()) for m in masks]
        recv = self._exchange(x, x_scales, topk_idx, topk_weights, is_token_in_rank, rows_per_source)
        if not internode:  # the source token indices the kernels carried (intranode.cu L482-487)
            assert torch.equal(recv["src_idx"].cpu(), handle[3].cpu()), "double: receive order disagrees with layout"
        recv_topk_idx = recv_topk_weights = None
        if topk_idx is not None:
            # intranode.cu L366-378 (sender side) / internode.cu L1171-1178 (receiver side): a slot keeps its expert
            # as a local id when the expert lives on the receiving rank, else -1, and its weight only there (else 0.0)
            local = num_experts // self.group_size
            begin = self.rank * local
            ids = recv["topk_idx"]
            is_local = (ids >= begin) & (ids < begin + local)
            recv_topk_idx = torch.where(is_local, ids - begin, -1).to(topk_idx.dtype)
            recv_topk_weights = torch.where(is_local, recv["topk_weights"], 0.0)
        counts = self._recv_tokens_per_expert(num_tokens_per_expert, expert_alignment)
        recv_x = (recv["x"], recv["scales"]) if x_scales is not None else recv["x"]
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, EventOverlap()

    def _recv_tokens_per_expert(self, num_tokens_per_expert: torch.Tensor, alignment: int) -> list[int]:
        """intranode.cu L65-74 / internode.cu L270-286: each local expert's slots summed over the source ranks'
        num_tokens_per_expert, rounded up to expert_alignment; a Python list (buffer.py L366-368)."""
        local = num_tokens_per_expert.shape[0] // self.group_size
        gathered = self._all_gather_rows(num_tokens_per_expert.unsqueeze(0))
        mine = torch.stack([g[0, self.rank * local:(self.rank + 1) * local].long().cpu() for g in gathered]).sum(0)
        return [(int(c) + alignment - 1) // alignment * alignment for c in mine]

    # ------------------------------------------------------------ combine

    def combine(self, x: torch.Tensor, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """buffer.py L405-451: the rows go back to their source ranks and are added WITHOUT weights (L413); with
        topk_weights [R, K] float those are added too. Returns (combined_x, combined_topk_weights or None, event).

        The sums: layout.combine_rows. Both modes first rewrite the handle's head tensors in place
        (layout.rewrite_*)."""
        self._check_available()
        if bias is not None:
            raise NotImplementedError("the deep_ep double does not model combine's bias")
        config = self.get_combine_config(self.group_size) if config is None else config
        internode = self.num_rdma_ranks > 1
        channels = config.num_sms // 2
        self._check_tokens(x, None, combine=True)
        num_topk = 0 if topk_weights is None else topk_weights.shape[1]
        if topk_weights is not None:
            host_assert(topk_weights.dtype == torch.float32 and topk_weights.dim() == 2 and topk_weights.is_contiguous()
                        and topk_weights.shape[0] == x.shape[0], "topk_weights float [num_recv_tokens, num_topk]")
        self._check_room(config, x, None, num_topk, internode, dispatch=False)
        if internode:
            is_token_in_rank, rows_per_source = handle[0], layout.internode_rows_per_source(handle)
            host_assert(x.shape[0] == handle[7].shape[0], "num_tokens == recv_src_meta.size(0)")
            layout.rewrite_heads_for_internode_combine(handle, channels)
        else:
            is_token_in_rank, rows_per_source = handle[4], layout.intranode_rows_per_source(handle, self.rank)
            host_assert(x.shape[0] == handle[3].shape[0], "src_idx.size(0) == num_tokens")  # deep_ep.cpp L799
            layout.rewrite_send_head_for_combine(handle[5], channels)
        back = self._return(x, topk_weights, is_token_in_rank, rows_per_source)
        combined_x = layout.combine_rows(back["x"], is_token_in_rank, internode).to(x.dtype)
        combined_w = None
        if topk_weights is not None:
            combined_w = layout.combine_rows(back["topk_weights"], is_token_in_rank, internode)
        return combined_x, combined_w, EventOverlap()

    # ------------------------------------------------------------ checks

    def _check_available(self) -> None:
        assert self.runtime is not None, "the buffer was destroyed"  # deep_ep.cpp: every call needs is_available()

    def _check_tokens(self, x: torch.Tensor, x_scales, combine: bool = False) -> None:
        """The host checks (deep_ep.cpp L500-560, L785-803) and the docstrings' dtypes (buffer.py L340-342, L420),
        plus the device traps DeepEP would hit, raised as DeepEPDeviceTrap."""
        host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        host_assert((x.shape[1] * x.element_size()) % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        if x_scales is None:
            if x.dtype != torch.bfloat16:
                raise TypeError(f"deep_ep {'combine' if combine else 'dispatch'} takes bfloat16 rows, got {x.dtype}")
        else:
            host_assert(x.element_size() == 1, "x.element_size() == 1")  # deep_ep.cpp L552
            if x.dtype != torch.float8_e4m3fn or x_scales.dtype != torch.float32 or x_scales.dim() != 2 \
                    or x.shape[1] % 128 or tuple(x_scales.shape) != (x.shape[0], x.shape[1] // 128):
                raise TypeError(f"deep_ep dispatch takes FP8 as (float8_e4m3fn [num_tokens, hidden], float "
                                f"[num_tokens, hidden // 128]), got ({x.dtype} {tuple(x.shape)}, {x_scales.dtype} "
                                f"{tuple(x_scales.shape)})")
        hidden_int4 = x.shape[1] * x.element_size() // 16
        internode = self.num_rdma_ranks > 1
        if not combine and not internode:
            # intranode.cu L290: the receiver stages half a row and an 8-byte mbarrier per warp in 8 KiB
            if hidden_int4 % 2 or hidden_int4 * 8 + 8 > INTRANODE_SMEM_PER_WARP:
                raise DeepEPDeviceTrap(f"intranode dispatch of {x.shape[1]} x {x.element_size()}-byte values: "
                                       "hidden_int4 % 2 == 0 and half_hidden_bytes + 8 <= 8192 fails on the device")
        if combine and internode and hidden_int4 % 32:  # internode.cu L1583: the forwarders' TMA combine
            raise DeepEPDeviceTrap(f"internode combine of hidden={x.shape[1]}: hidden_int4 % 32 == 0 fails on the "
                                   "device")

    def _check_room(self, config: Config, x, x_scales, num_topk: int, internode: bool, dispatch: bool,
                    num_experts: int = 0) -> None:
        """Whether the buffers hold one queue set: deep_ep.cpp L605 and L681-690 (intranode dispatch), L835 and
        L857-864 (intranode combine); internode.cu L412-428 (notify_dispatch) and L1499-1512 (cached_notify)."""
        world, channels = self.group_size, config.num_sms // 2
        hidden_bytes = x.shape[1] * x.element_size()
        num_scales = 0 if x_scales is None else x_scales.shape[1]
        if internode:
            hidden_int4, rdma_ranks = hidden_bytes // 16, self.num_rdma_ranks
            per_token = _bytes_per_token(hidden_int4, num_scales, num_topk)
            if dispatch and per_token + 8 > INTERNODE_SMEM_PER_WARP:  # internode.cu L573
                raise DeepEPDeviceTrap(f"internode dispatch: {per_token} bytes a token + 8 > 16384 fails on the device")
            rdma = per_token * config.num_max_rdma_chunked_recv_tokens * rdma_ranks * 2 * channels \
                + (NUM_MAX_NVL_PEERS * 2 + 4) * rdma_ranks * 2 * channels * 4
            nvl = config.num_max_nvl_chunked_recv_tokens * per_token * NUM_MAX_NVL_PEERS * channels \
                + NUM_MAX_NVL_PEERS * (2 * rdma_ranks + 2) * channels * 4
            host_assert(rdma <= self.num_rdma_bytes, f"rdma clean meta ({rdma} bytes) <= num_rdma_bytes "
                                                     f"({self.num_rdma_bytes})")
            host_assert(nvl <= self.num_nvl_bytes, f"nvl clean meta ({nvl} bytes) <= num_nvl_bytes "
                                                   f"({self.num_nvl_bytes})")
            return
        queue = channels * world * config.num_max_nvl_chunked_recv_tokens
        if dispatch:
            if num_experts:
                host_assert(world * (world + num_experts // world) * 4 <= self.num_nvl_bytes,
                            "num_ranks * (num_ranks + num_local_experts) * sizeof(int) <= num_nvl_bytes")
            need = world * world * 4 + channels * world * 4 * 4 + queue * (hidden_bytes + 4 + num_topk * 8
                                                                           + num_topk * 4 + 4 * num_scales)
        else:
            need = channels * world * 4 * 2 + queue * (hidden_bytes + 4 + num_topk * 4)
        host_assert(need <= self.num_nvl_bytes, f"intranode queues ({need} bytes) <= num_nvl_bytes "
                                                f"({self.num_nvl_bytes})")

    # ------------------------------------------------------------ moving rows

    def _all_gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` ([n_r, ...], n_r may differ), in rank order."""
        sizes = [torch.zeros(1, dtype=torch.int64, device=t.device) for _ in range(self.group_size)]
        dist.all_gather(sizes, torch.tensor([t.shape[0]], dtype=torch.int64, device=t.device), group=self.group)
        sizes = [int(s) for s in sizes]
        padded = t.new_zeros((max(sizes), *t.shape[1:]))
        padded[:t.shape[0]] = t
        out = [torch.empty_like(padded) for _ in range(self.group_size)]
        dist.all_gather(out, padded.contiguous(), group=self.group)
        return [o[:n] for o, n in zip(out, sizes)]

    def _exchange(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, rows_per_source) -> dict:
        """Rows (with scales, top-k ids and weights and the source token index) to every rank they go to, received by
        source rank then token: one all_to_all_single of bytes."""
        n = x.shape[0]
        fields = {"x": x}
        if x_scales is not None:
            fields["scales"] = x_scales
        if topk_idx is not None:
            fields["topk_idx"], fields["topk_weights"] = topk_idx, topk_weights
        fields["src_idx"] = torch.arange(n, dtype=torch.int32, device=x.device).unsqueeze(1)
        received = self._send_rows(fields, is_token_in_rank, rows_per_source)
        received["src_idx"] = received["src_idx"][:, 0]
        return received

    def _return(self, y, topk_weights, is_token_in_rank, rows_per_source) -> dict:
        """The reverse of _exchange: received rows (source rank, token order) back, grouped by destination rank."""
        fields = {"x": y} if topk_weights is None else {"x": y, "topk_weights": topk_weights}
        send_counts = rows_per_source
        recv_counts = is_token_in_rank.sum(0).tolist()
        return self._all_to_all(fields, None, send_counts, recv_counts)

    def _send_rows(self, fields: dict, is_token_in_rank, rows_per_source) -> dict:
        order = layout.send_order(is_token_in_rank.cpu()).to(is_token_in_rank.device)
        return self._all_to_all(fields, order, is_token_in_rank.sum(0).tolist(), rows_per_source)

    def _all_to_all(self, fields: dict, order, send_counts, recv_counts) -> dict:
        payload = torch.cat([_as_bytes(t) for t in fields.values()], dim=1)
        if order is not None:
            payload = payload[order]
        out = payload.new_empty((sum(recv_counts), payload.shape[1]))
        dist.all_to_all_single(out, payload.contiguous(), [int(c) for c in recv_counts], [int(c) for c in send_counts],
                               group=self.group)
        received, start = {}, 0
        for name, t in fields.items():
            width = _as_bytes(t).shape[1]
            received[name] = out[:, start:start + width].contiguous().view(t.dtype).reshape(out.shape[0], *t.shape[1:])
            start += width
        return received


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, ...] as [rows, bytes] uint8 (gloo and NCCL move any dtype as bytes, float8 included)."""
    width = 1
    for size in t.shape[1:]:
        width *= size
    return t.contiguous().reshape(t.shape[0], width).view(torch.uint8)
