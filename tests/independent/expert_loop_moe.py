"""A small MoE whose expert loop is DeepSeek-V3's reference `inference/model.py` MoE.forward, as written.

Tokens per expert are counted on the host (`torch.bincount(...).tolist()`), experts with no tokens are skipped
(`if counts[i] == 0: continue`), and each expert runs on the rows `torch.where(indices == i)` selects (or, with
select="nonzero", `(indices == i).nonzero()`; select="mixed": even experts `where`, odd ones `nonzero`). Under Dynamo's capture_scalar_outputs and
capture_dynamic_output_shape_ops this loop fails to trace (GuardOnDataDependentSymNode at the `.tolist()`); without
them it graph-breaks there and at each selection.

Imports nothing from moepass (a process that never imported moepass can build it). Import: put this folder on
sys.path and `import expert_loop_moe`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM = 64  # every GEMM's K and N a multiple of 32 (MXFP8 blocks), but the router gate's N (the expert count)


class Expert(nn.Module):
    """inference/model.py's Expert: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)
        self.w2 = nn.Linear(inter_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, inter_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    def __init__(self, dim: int = DIM, inter_dim: int = DIM, n_experts: int = 4, top_k: int = 2,
                 select: str = "where"):
        super().__init__()
        self.dim, self.n_experts, self.top_k, self.select = dim, n_experts, top_k, select
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, inter_dim) for _ in range(n_experts))

    def forward(self, x):
        shape = x.size()
        x = x.view(-1, self.dim)
        weights, indices = self.gate(x).float().softmax(dim=-1).topk(self.top_k, dim=-1)
        weights = weights.type_as(x)
        y = torch.zeros_like(x)
        counts = torch.bincount(indices.flatten(), minlength=self.n_experts).tolist()
        for i in range(self.n_experts):
            if counts[i] == 0:
                continue
            expert = self.experts[i]
            if self.select == "where" or self.select == "mixed" and i % 2 == 0:
                idx, top = torch.where(indices == i)
            else:
                idx, top = (indices == i).nonzero().unbind(-1)
            y[idx] += expert(x[idx]) * weights[idx, top, None]
        return y.view(shape)


class LoopMoEModel(nn.Module):
    """x -> proj -> x + LoopMoE -> head; the head is the model's last GEMM."""

    def __init__(self, select: str = "where", n_experts: int = 4):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.moe = LoopMoE(n_experts=n_experts, select=select)
        self.head = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        h = self.proj(x)
        return self.head(h + self.moe(h))


def build(select: str = "where", n_experts: int = 4, seed: int = 0) -> LoopMoEModel:
    """BF16 weights (the low-precision passes rewrite BF16 GEMMs), seeded."""
    torch.manual_seed(seed)
    return LoopMoEModel(select, n_experts).to(torch.bfloat16)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, regression target) of one training step, [2, 16, DIM] each: the target is the input's features
    reversed, a map the model learns (3 steps take its loss ~15% below the untrained model's)."""
    x = torch.randn(2, 16, DIM, generator=torch.Generator().manual_seed(100 + step)).to(torch.bfloat16)
    return x, x.flip(-1)


def train_losses(model: nn.Module, forward, steps: int = 3, lr: float = 2.0) -> list[float]:
    """`steps` SGD steps of mse(forward(x), target); the loss of each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, target = batch(step)
        loss = F.mse_loss(forward(x).float(), target.float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


if __name__ == "__main__":
    model = build()
    print("eager losses", train_losses(model, model))
