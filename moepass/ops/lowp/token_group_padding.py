"""Pad token groups to multiples of a recipe's block of rows (MXFP8's 32, blockwise FP8's 128) without a host sync,
and undo it: for the grouped GEMMs whose wgrad reduces over tokens in blocks that must not straddle two groups.

Same padded layout as torchao's torch_pad_token_groups (group g starts at the block-aligned
cumulative padded offset, zeros elsewhere, round_up(M + block * E, block) rows), so the GEMMs see
identical operands. Unlike torchao's, tokens at or after offs[-1] are allowed: they are
zeroed in the padded buffer and come back as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenGroupPadding:
    padded_offs: torch.Tensor  # int32 [E]: group ends in the padded buffer
    token_rows: torch.Tensor  # int64 [M]: padded row of each original token
    in_group: torch.Tensor  # bool [M, 1]: token < offs[-1]
    padded_rows: int


def plan_token_group_padding(offs: torch.Tensor, num_tokens: int, block: int) -> TokenGroupPadding:
    ends = offs.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_sizes = (sizes + block - 1) // block * block
    padded_ends = torch.cumsum(padded_sizes, 0)
    # Row shift per group; one extra entry moves trailing tokens right after the last padded group.
    shift = torch.cat([padded_ends - padded_sizes - (ends - sizes), (padded_ends[-1:] - ends[-1:])])
    tokens = torch.arange(num_tokens, device=offs.device)
    group = torch.searchsorted(ends, tokens, right=True)
    padded_rows = (num_tokens + block * offs.numel() + block - 1) // block * block
    return TokenGroupPadding(
        padded_offs=padded_ends.to(torch.int32),
        token_rows=tokens + shift[group],
        in_group=(tokens < ends[-1:]).unsqueeze(-1),
        padded_rows=padded_rows,
    )


def pad_token_groups(t: torch.Tensor, plan: TokenGroupPadding) -> torch.Tensor:
    """[M, D] -> [padded_rows, D]; padding rows and tokens outside every group are zero."""
    rows = torch.where(plan.in_group, t, t.new_zeros(()))
    return t.new_zeros(plan.padded_rows, t.shape[-1]).index_copy(0, plan.token_rows, rows)


def unpad_token_groups(padded: torch.Tensor, plan: TokenGroupPadding) -> torch.Tensor:
    """[padded_rows, D] -> [M, D]; tokens outside every group get zeros (the GEMM leaves them undefined)."""
    return torch.where(plan.in_group, padded.index_select(0, plan.token_rows), padded.new_zeros(()))
