"""Where DeepEP V1 puts every row, and what its handles hold, as pure functions of every rank's routing.

Each function takes what the double gathers from all ranks (`masks[s]` = rank s's is_token_in_rank [N_s, W]) and
returns one rank's view, so the layouts can be checked in one process for any group size (16 ranks as 2 nodes of 8
included). Sources: deepseek-ai/DeepEP@567632d, csrc/kernels/{layout,intranode,internode}.cu, utils.cuh.

Shared facts:
- a source rank's tokens are split into C = num_sms / 2 channels of ceil(N / C) consecutive tokens
  (utils.cuh L434 get_channel_task_range); every per-channel matrix below uses that split of the SOURCE's N;
- a rank receives its rows ordered by source rank, then by token: intranode the receiver writes source s's
  channel c at rank_prefix_matrix[s-1][me] + (s's tokens for me before channel c) (intranode.cu L414-429), internode
  at recv_gbl_rank_prefix_sum[s-1] + the same offset, one running offset per source (internode.cu L1059-1130);
- within a channel tokens keep their order: the channel queues are FIFO (intranode.cu L327-395).
"""

from __future__ import annotations

import torch

from .config import NUM_MAX_NVL_PEERS

INT32 = torch.int32
HEAD_SENTINEL = 1 << 25  # intranode.cu L641 / internode.cu L1383: "a heuristic large number" for the last head


def channel_ranges(num_tokens: int, num_channels: int) -> list[tuple[int, int]]:
    """utils.cuh L434-438 get_channel_task_range: [start, end) of each channel."""
    per = -(-num_tokens // num_channels)
    ranges = []
    for c in range(num_channels):
        start = min(per * c, num_tokens)
        ranges.append((start, min(start + per, num_tokens)))
    return ranges


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """layout.cu L10-113 get_dispatch_layout: (num_tokens_per_rank int32 [W], num_tokens_per_rdma_rank int32
    [W/8] or None within a node, num_tokens_per_expert int32 [E], is_token_in_rank bool [N, W]).

    A slot counts for expert e when 0 <= e < E (-1 is "no selection"); a token counts once per rank and once per
    node however many of its experts live there; num_tokens_per_expert counts slots."""
    routed = (topk_idx >= 0) & (topk_idx < num_experts)
    experts = torch.where(routed, topk_idx, num_experts)
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64).index_add_(
        0, experts.reshape(-1).cpu(), torch.ones(experts.numel(), dtype=torch.int64))[:num_experts]
    owner = torch.where(routed, topk_idx // (num_experts // num_ranks), -1)
    is_token_in_rank = (owner.unsqueeze(-1) == torch.arange(num_ranks, device=topk_idx.device)).any(dim=1).cpu()
    per_rank = is_token_in_rank.sum(0)
    per_rdma = None
    if num_ranks > NUM_MAX_NVL_PEERS:
        per_rdma = is_token_in_rank.view(-1, num_ranks // NUM_MAX_NVL_PEERS, NUM_MAX_NVL_PEERS).any(-1).sum(0)
        per_rdma = per_rdma.to(INT32)
    return per_rank.to(INT32), per_rdma, per_expert.to(INT32), is_token_in_rank


def receive_order(masks: list[torch.Tensor], rank: int) -> list[tuple[int, torch.Tensor]]:
    """[(source rank, its token indices sent here, ascending)] in source-rank order."""
    return [(s, mask[:, rank].nonzero()[:, 0]) for s, mask in enumerate(masks)]


def send_order(mask: torch.Tensor) -> torch.Tensor:
    """This rank's token indices in the order its rows leave: by destination rank, then token."""
    return mask.t().nonzero()[:, 1]


def _channel_prefix(columns: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[columns, C] int32: inclusive prefix over channels of the tokens marked in each column of `columns` [N, X]."""
    ends = [end for _, end in channel_ranges(columns.shape[0], num_channels)]
    totals = torch.cat([torch.zeros(1, columns.shape[1], dtype=torch.int64), columns.long().cumsum(0)])
    return totals[ends].t().contiguous().to(INT32)


def _start_offsets(mask_column: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[C]: the marked tokens of one column before each channel (exclusive prefix over the source's channels)."""
    starts = [start for start, _ in channel_ranges(mask_column.shape[0], num_channels)]
    totals = torch.cat([torch.zeros(1, dtype=torch.int64), mask_column.long().cumsum(0)])
    return totals[starts]


def _heads(columns: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[N, X] int32: a marked token's place among the marked tokens of its channel (the queue tail when it was sent),
    -1 where unmarked: intranode.cu L343-346 (send_head), internode.cu L630-663 (send_rdma_head)."""
    heads = torch.full(columns.shape, -1, dtype=INT32)
    for start, end in channel_ranges(columns.shape[0], num_channels):
        marked = columns[start:end].long()
        before = marked.cumsum(0) - marked
        heads[start:end] = torch.where(marked.bool(), before, -1).to(INT32)
    return heads


def combine_rows(rows: torch.Tensor, is_token_in_rank: torch.Tensor, internode: bool) -> torch.Tensor:
    """What combine makes of the rows sent back to this rank (grouped by destination rank, then token): per token, an
    fp32 sum from +0.0 (the caller casts it to the row dtype), as the kernels add:
    - intranode: the rows of the token's destination ranks in rank order, from bias 0 + 0 (intranode.cu L924-981;
      top-k weights L1012-1018);
    - internode: twice. On each node the rank of the source's GPU index sums the node's rows in local-rank order and
      writes the partial sum in the row dtype (combine_token<NUM_MAX_NVL_PEERS, ...> at internode.cu L2086, summing
      at L1618-1634); the source then adds the nodes' partial sums in node order (combine_token<kNumRDMARanks, ...>
      at L2202, from bias 0 + 0 at L1665-1688). Top-k weights the same way, fp32 between the two (L1693-1700)."""
    num_tokens, world = is_token_in_rank.shape
    mask = is_token_in_rank.cpu()
    order = send_order(mask)
    dest = torch.repeat_interleave(torch.arange(world), mask.sum(0))
    total = torch.zeros((num_tokens, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    nodes = [range(n * NUM_MAX_NVL_PEERS, (n + 1) * NUM_MAX_NVL_PEERS) for n in range(world // NUM_MAX_NVL_PEERS)]
    for ranks in nodes if internode else [range(world)]:
        partial = torch.zeros_like(total) if internode else total
        for r in ranks:  # a destination's rows are distinct tokens: one exact add each
            pick = (dest == r).nonzero()[:, 0]
            partial.index_add_(0, order[pick].to(rows.device), rows[pick.to(rows.device)].float())
        if internode:
            total += partial.to(rows.dtype).float()  # fp32 top-k weights pass through unchanged
    return total


# ---------------------------------------------------------------- intranode (W <= 8)


def intranode_handle(masks: list[torch.Tensor], rank: int, num_channels: int) -> tuple[torch.Tensor, ...]:
    """buffer.py dispatch L398: (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix,
    recv_src_idx, is_token_in_rank, send_head).

    - rank_prefix_matrix [W, W]: [i][j] = rows ranks 0..i send to rank j (intranode.cu L40-61, the same on every rank);
    - channel_prefix_matrix [W, C]: this rank's tokens for rank d in channels 0..c (L92-110);
    - recv_channel_prefix_matrix [W, C]: source s's tokens for this rank before channel c (L304-310 sent, L414-425
      kept without the rank offset);
    - recv_src_idx [R]: each received row's token index at its source (L482-487);
    - send_head [N, W]: a token's place in its channel's queue to rank d, -1 if not sent there (L343-346)."""
    counts = torch.stack([mask.sum(0) for mask in masks])
    rank_prefix_matrix = counts.cumsum(0).to(INT32)
    own = masks[rank]
    channel_prefix_matrix = _channel_prefix(own, num_channels)
    recv_channel_prefix_matrix = torch.stack([_start_offsets(m[:, rank], num_channels) for m in masks]).to(INT32)
    recv_src_idx = torch.cat([tokens for _, tokens in receive_order(masks, rank)]).to(INT32)
    send_head = _heads(own, num_channels)
    return (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, own.clone(),
            send_head)


def intranode_rows_per_source(handle: tuple, rank: int) -> list[int]:
    """Rows this rank received from each source, read off a handle's rank_prefix_matrix (as the kernels do)."""
    column = handle[0][:, rank].long()
    return torch.diff(column, prepend=column.new_zeros(1)).tolist()


def rewrite_send_head_for_combine(send_head: torch.Tensor, num_channels: int) -> None:
    """intranode.cu L612-657 cached_notify_combine, run by every combine on the handle's send_head IN PLACE: walking
    each channel backwards, an unsent entry becomes -(the next sent token's head, or 1<<25) - 1. Idempotent."""
    _rewrite_heads(send_head, channel_ranges(send_head.shape[0], num_channels))


def _rewrite_heads(heads: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
    for column in range(heads.shape[1]):
        values = heads[:, column].tolist()
        for start, end in ranges:
            last_head = HEAD_SENTINEL
            for t in range(end - 1, start - 1, -1):
                if values[t] < 0:
                    values[t] = -last_head - 1
                else:
                    last_head = values[t]
        # through .data: the kernel writes through a pointer, which autograd's version counter never sees (the
        # handle is saved for the backward when combine runs)
        heads.data[:, column] = torch.tensor(values, dtype=heads.dtype)


# ---------------------------------------------------------------- internode (W = 8 * nodes)


def _node(mask: torch.Tensor, node: int) -> torch.Tensor:
    return mask[:, node * NUM_MAX_NVL_PEERS:(node + 1) * NUM_MAX_NVL_PEERS]


def _per_node(mask: torch.Tensor) -> torch.Tensor:
    """[N, nodes]: the token goes to some rank of that node."""
    return mask.view(mask.shape[0], -1, NUM_MAX_NVL_PEERS).any(-1)


def internode_handle(masks: list[torch.Tensor], rank: int, num_channels: int) -> tuple[torch.Tensor, ...]:
    """buffer.py internode_dispatch L495-497: (is_token_in_rank, rdma_channel_prefix_matrix, gbl_channel_prefix_matrix,
    recv_rdma_channel_prefix_matrix, recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix,
    recv_gbl_rank_prefix_sum, recv_src_meta, send_rdma_head, send_nvl_head). Node of rank r = r // 8; a token reaches
    rank r = node * 8 + i through the rank of its source's GPU index in that node (the RDMA hop) and NVLink.

    - rdma_channel_prefix_matrix [nodes, C] / gbl_channel_prefix_matrix [W, C]: this rank's tokens for each node / rank
      in channels 0..c (internode.cu L292-343);
    - recv_rdma_rank_prefix_sum [nodes]: tokens node n's rank of this GPU index sends to this node, prefix over n
      (L232-239); recv_rdma_channel_prefix_matrix [nodes, C]: that rank's rdma_channel_prefix_matrix row for this node
      (L865-870);
    - recv_gbl_rank_prefix_sum [W]: rows from ranks 0..s (L261-267); recv_gbl_channel_prefix_matrix [W, C]: where
      source s's channel c starts among the received rows, rank offset included (L1059-1097);
    - recv_src_meta [R, 8] uint8: SourceMeta(src node, bits of this node's ranks the token goes to) (L17-33, L1165);
    - send_rdma_head [N, nodes]: a token's place in its channel's RDMA queue to each node, -1 if not sent (L630-663);
    - send_nvl_head [R_rdma, 8]: for each token this GPU receives over RDMA (by source node, then token), its place in
      the NVLink queue to each local rank, -1 if not forwarded there (L950-972). DeepEP's forwarder serves the source
      nodes round-robin in arrival order, so only the -1 pattern of send_nvl_head is fixed; the double numbers the
      tokens in (source node, token) order."""
    world = len(masks)
    nodes, me_node, me_gpu = world // NUM_MAX_NVL_PEERS, rank // NUM_MAX_NVL_PEERS, rank % NUM_MAX_NVL_PEERS
    own = masks[rank]
    rdma_channel_prefix_matrix = _channel_prefix(_per_node(own), num_channels)
    gbl_channel_prefix_matrix = _channel_prefix(own, num_channels)
    peers = [n * NUM_MAX_NVL_PEERS + me_gpu for n in range(nodes)]  # this GPU index on every node
    to_my_node = [_per_node(masks[p])[:, me_node] for p in peers]
    recv_rdma_rank_prefix_sum = torch.stack([m.sum() for m in to_my_node]).cumsum(0).to(INT32)
    recv_rdma_channel_prefix_matrix = torch.stack(
        [_channel_prefix(m.unsqueeze(1), num_channels)[0] for m in to_my_node]).to(INT32)
    rows = torch.stack([m[:, rank].sum() for m in masks])
    recv_gbl_rank_prefix_sum = rows.cumsum(0).to(INT32)
    before = torch.cat([rows.new_zeros(1), rows.cumsum(0)[:-1]])
    recv_gbl_channel_prefix_matrix = torch.stack(
        [before[s] + _start_offsets(m[:, rank], num_channels) for s, m in enumerate(masks)]).to(INT32)
    metas = []
    for s, tokens in receive_order(masks, rank):
        bits = (_node(masks[s], me_node)[tokens].long() << torch.arange(NUM_MAX_NVL_PEERS)).sum(-1)
        metas.append(torch.stack([torch.full_like(bits, s // NUM_MAX_NVL_PEERS), bits], dim=1))
    recv_src_meta = torch.cat(metas).to(INT32).contiguous().view(torch.uint8)
    send_rdma_head = _heads(_per_node(own), num_channels)
    send_nvl_head = _nvl_heads([masks[p] for p in peers], me_node, num_channels)
    return (own.clone(), rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
            recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum, recv_src_meta,
            send_rdma_head, send_nvl_head)


def _nvl_heads(peer_masks: list[torch.Tensor], node: int, num_channels: int) -> torch.Tensor:
    """[R_rdma, 8]: per forwarder channel one counter per local rank, over the source nodes in order."""
    segments, counters = [], [torch.zeros(NUM_MAX_NVL_PEERS, dtype=torch.int64) for _ in range(num_channels)]
    for mask in peer_masks:
        local = _node(mask, node)
        for c, (start, end) in enumerate(channel_ranges(mask.shape[0], num_channels)):
            arriving = local[start:end][local[start:end].any(-1)].long()  # tokens of channel c for this node
            places = counters[c] + arriving.cumsum(0) - arriving
            counters[c] += arriving.sum(0)
            segments.append(torch.where(arriving.bool(), places, -1))
    return torch.cat(segments).to(INT32) if segments else torch.empty(0, NUM_MAX_NVL_PEERS, dtype=INT32)


def internode_rows_per_source(handle: tuple) -> list[int]:
    column = handle[6].long()
    return torch.diff(column, prepend=column.new_zeros(1)).tolist()


def rewrite_heads_for_internode_combine(handle: tuple, num_channels: int) -> None:
    """internode.cu L1311-1470 cached_notify, run by every internode combine IN PLACE: send_rdma_head walked back per
    channel of this rank's tokens (L1375-1394), send_nvl_head per (source node, channel) segment of the rows received
    over RDMA, from recv_rdma_channel_prefix_matrix and recv_rdma_rank_prefix_sum (L1420-1470)."""
    send_rdma_head, send_nvl_head = handle[8], handle[9]
    _rewrite_heads(send_rdma_head, channel_ranges(send_rdma_head.shape[0], num_channels))
    prefix, shifts = handle[3].long(), handle[4].long()
    ranges = []
    for n in range(prefix.shape[0]):
        shift = int(shifts[n - 1]) if n else 0
        ends = prefix[n].tolist()
        ranges += [(shift + (ends[c - 1] if c else 0), shift + ends[c]) for c in range(num_channels)]
    _rewrite_heads(send_nvl_head, ranges)
