"""SwiGLU feed-forward: the dense FFN of the first layers and the MoE's shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """Truncated normal at +-3 std, the init every projection in this model uses."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False, dtype=dtype)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        # torchtitan: w1 at the base std, w2/w3 (feeding the residual) depth-scaled
        trunc_normal_(self.w1.weight, std)
        trunc_normal_(self.w2.weight, out_std)
        trunc_normal_(self.w3.weight, out_std)
