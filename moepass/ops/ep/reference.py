"""Expert-parallel dispatch/combine over torch.distributed all_to_all_single (gloo or NCCL).

Same semantics as DeepEP V1 normal-mode ``Buffer.dispatch`` / ``Buffer.combine``: a token goes once to
each rank that owns at least one of its experts; received rows are ordered by source rank, then source
token index; combine sums a token's rows in fp32 in rank order, without weights.

Handle (a list of tensors, so it fits a custom-op schema):
    [0] is_token_in_rank  bool  [N, W]   token t is sent to rank r
    [1] recv_src_idx      int32 [R]      source token index of each received row
    [2] send_counts       int64 [W]      rows sent to each rank
    [3] recv_counts       int64 [W]      rows received from each rank
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import EPBackend

HANDLE_IS_TOKEN_IN_RANK = 0
HANDLE_RECV_SRC_IDX = 1


def _all_to_all_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts, group=group)
    return out


def _send_token_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    # Row-major nonzero over [W, N]: tokens grouped by destination rank, then by token index.
    return is_token_in_rank.t().nonzero()[:, 1]


class ReferenceEP(EPBackend):
    name = "reference"

    def size_carriers(self, group_size: int) -> tuple[int, int]:
        return HANDLE_IS_TOKEN_IN_RANK, HANDLE_RECV_SRC_IDX

    def fake_handle(self, x: torch.Tensor, num_recv, group_size: int) -> list[torch.Tensor]:
        return [
            x.new_empty((x.shape[0], group_size), dtype=torch.bool),
            x.new_empty((num_recv,), dtype=torch.int32),
            x.new_empty((group_size,), dtype=torch.int64),
            x.new_empty((group_size,), dtype=torch.int64),
        ]

    def dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group_name: str,
        group
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        world = group.size()
        experts_per_rank = num_experts // world
        if topk_idx.numel() and int(topk_idx.max()) >= num_experts:
            raise ValueError(f"topk_idx holds expert {int(topk_idx.max())}, but num_experts={num_experts}")
        routed = topk_idx >= 0
        dest_rank = torch.where(routed, topk_idx // experts_per_rank, -1)
        ranks = torch.arange(world, device=x.device)
        is_token_in_rank = (dest_rank.unsqueeze(-1) == ranks).any(dim=1)
        send_counts = is_token_in_rank.sum(dim=0).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_split, recv_split = send_counts.tolist(), recv_counts.tolist()

        send_token = _send_token_order(is_token_in_rank)
        send_dest = torch.repeat_interleave(ranks, send_counts)
        send_topk = topk_idx[send_token]
        is_local = (send_topk >= 0) & (send_topk // experts_per_rank == send_dest.unsqueeze(-1))
        send_local_idx = torch.where(is_local, send_topk - send_dest.unsqueeze(-1) * experts_per_rank, -1)
        send_weights = torch.where(is_local, topk_weights[send_token], 0.0)
        # One int64 exchange carries local expert ids and the source token index.
        send_meta = torch.cat([send_local_idx, send_token.unsqueeze(-1)], dim=1)

        recv_x = _all_to_all_rows(x[send_token], send_split, recv_split, group)
        recv_meta = _all_to_all_rows(send_meta, send_split, recv_split, group)
        recv_topk_weights = _all_to_all_rows(send_weights, send_split, recv_split, group)
        recv_topk_idx = recv_meta[:, :-1].contiguous()
        recv_src_idx = recv_meta[:, -1].to(torch.int32)
        num_recv_tokens_per_expert = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=experts_per_rank)
        handle = [is_token_in_rank, recv_src_idx, send_counts, recv_counts]
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle

    def dispatch_fp8(self, x_q, x_scale, topk_idx, topk_weights, num_experts: int, group_name: str, group):
        # gloo and NCCL move float8 as bytes
        recv_q, recv_idx, recv_w, counts, handle = self.dispatch(
            x_q.view(torch.uint8), topk_idx, topk_weights, num_experts, group_name, group)
        recv_scale = self.dispatch_cached(x_scale, handle, group_name, group)
        return recv_q.view(x_q.dtype), recv_scale, recv_idx, recv_w, counts, handle

    def combine(self, y: torch.Tensor, handle: list[torch.Tensor], group_name: str, group) -> torch.Tensor:
        """Rows in receive order back to their source tokens, summed in fp32 in rank order."""
        is_token_in_rank, _, send_counts, recv_counts = handle
        send_split = send_counts.tolist()
        returned = _all_to_all_rows(y, recv_counts.tolist(), send_split, group)
        send_token = _send_token_order(is_token_in_rank)
        total = torch.zeros((is_token_in_rank.shape[0], *y.shape[1:]), dtype=torch.float32, device=y.device)
        start = 0
        # Each rank's rows hit distinct tokens, so each index_add_ is exact and the rank order is kept.
        for count in send_split:
            stop = start + count
            total.index_add_(0, send_token[start:stop], returned[start:stop].float())
            start = stop
        return total.to(y.dtype)

    def dispatch_cached(self, x: torch.Tensor, handle: list[torch.Tensor], group_name: str, group) -> torch.Tensor:
        """Dispatch rows of x with the layout of an earlier dispatch (combine's backward)."""
        is_token_in_rank, _, send_counts, recv_counts = handle
        send_token = _send_token_order(is_token_in_rank)
        return _all_to_all_rows(x[send_token], send_counts.tolist(), recv_counts.tolist(), group)

    def dispatch_backward(self, grad_recv_x, grad_recv_topk_weights, handle, group_name: str, group):
        return (self.combine(grad_recv_x, handle, group_name, group),
                self.combine(grad_recv_topk_weights, handle, group_name, group))
