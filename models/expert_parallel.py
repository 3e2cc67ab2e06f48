"""Expert parallelism: the standard all-to-all token dispatch and combine (torchtitan style).

Each of the ep_size ranks of the group owns the contiguous experts
[ep_rank * E / ep_size, (ep_rank + 1) * E / ep_size). `dispatch` sends every routed token
row to the rank that owns its expert and lays the received rows out expert-major for the
grouped GEMMs; `combine` undoes both steps. Routing weights are not touched here: the
caller applies them when it scatters rows back to tokens (DeepEP's combine contract).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class EPDispatchState(NamedTuple):
    """What `combine` needs to send rows back where `dispatch` got them."""

    input_splits: list[int]  # rows this rank sent to each rank
    output_splits: list[int]  # rows this rank received from each rank
    expert_major_order: torch.Tensor  # received (rank-major) row index of each expert-major row


def ep_rank_and_size(group: dist.ProcessGroup) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def local_expert_range(num_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """[first, last) global expert ids owned by ep_rank."""
    if num_experts % ep_size:
        raise ValueError(f"{num_experts} experts cannot be split evenly over {ep_size} expert-parallel ranks")
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def shard_experts(full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    """This rank's slice (a copy) of a full [E, ...] expert weight."""
    first, last = local_expert_range(full.shape[0], ep_rank, ep_size)
    return full[first:last].clone()


def dispatch(
    routed_input: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    group: dist.ProcessGroup,
    ep_size: int,
) -> tuple[torch.Tensor, torch.Tensor, EPDispatchState]:
    """Send rows to their experts' ranks.

    routed_input: [N, D] rows sorted by global expert id; tokens_per_expert: [E] row counts.
    Returns the received rows [R, D] sorted by local expert id, their counts [E_local], and
    the state for `combine`.
    """
    num_local_experts = tokens_per_expert.shape[0] // ep_size
    with torch.no_grad():
        # row r of the result: how many rows rank r sends to each of this rank's experts
        received_counts = funcol.all_to_all_single(tokens_per_expert, None, None, group).view(ep_size, num_local_experts)
        # split sizes leave the device here (host sync); under torch.compile they become unbacked SymInts
        input_splits = tokens_per_expert.view(ep_size, num_local_experts).sum(dim=1).tolist()
        output_splits = received_counts.sum(dim=1).tolist()

    received = funcol.all_to_all_single_autograd(routed_input, output_splits, input_splits, group)

    # received rows are rank-major (r0: e0 e1 .., r1: e0 e1 ..); a stable sort on the local
    # expert id makes them expert-major (e0: r0 r1 .., e1: r0 r1 ..) keeping token order
    local_expert_of_row = torch.repeat_interleave(
        torch.arange(num_local_experts, device=received.device).repeat(ep_size),
        received_counts.reshape(-1),
        output_size=received.shape[0],
    )
    expert_major_order = torch.argsort(local_expert_of_row, stable=True)
    tokens_per_local_expert = received_counts.sum(dim=0)
    state = EPDispatchState(input_splits, output_splits, expert_major_order)
    return received[expert_major_order], tokens_per_local_expert, state


def combine(local_output: torch.Tensor, state: EPDispatchState, group: dist.ProcessGroup) -> torch.Tensor:
    """Send expert outputs [R, D] back; returns [N, D] in the row order `dispatch` was given."""
    rank_major = torch.zeros_like(local_output).index_copy(0, state.expert_major_order, local_output)
    return funcol.all_to_all_single_autograd(rank_major, state.input_splits, state.output_splits, group)
