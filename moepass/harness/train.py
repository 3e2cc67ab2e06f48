"""A plain training step (forward, loss, backward, AdamW) shared by demo, bench and converge."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def with_loss(forward: Callable) -> Callable:
    """forward(tokens) -> logits as (tokens, targets) -> loss: compiled, the loss joins the model's graph."""

    def loss_of(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return next_token_loss(forward(tokens), targets)

    return loss_of


@dataclasses.dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    # CUDA allocator bytes in use before the forward and right after it (None off CUDA): their difference is what
    # the forward keeps for the backward (saved activations and the loss), the part of a peak a recipe can change
    allocated_before_forward: int | None = None
    allocated_after_forward: int | None = None


def allocated_bytes(device: torch.device) -> int | None:
    """The allocator's bookkeeping, read on the host: no synchronization, so the step's timing is not disturbed."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def optimizer_name(device: torch.device) -> str:
    """What adamw() builds on `device`, for the bench and converge JSON (the step time depends on it)."""
    return "AdamW (fused)" if device.type == "cuda" else "AdamW (torch's default implementation)"


def adamw(params, lr: float, device: torch.device) -> torch.optim.AdamW:
    """The AdamW every variant trains with: fused on CUDA, torchtitan's default ("implementation": "fused").

    One kernel per parameter group instead of foreach's chain of passes over every weight, gradient and moment
    (what foreach cost at DeepSeek-V3 671B dims: examples/results/bench_671B_l3_peers_fused_h200/).
    Forced rather than left to torch, which falls back to its per-parameter loop for every parameter once one
    is a tensor subclass (torchao's weights in the peer variants); the fused kernel takes those too.
    """
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True if device.type == "cuda" else None)


def train(model: torch.nn.Module, forward: Callable, batches, steps: int, device: torch.device,
          lr: float = 3e-4, on_step: Callable[[StepResult], None] | None = None,
          optimizer: torch.optim.Optimizer | None = None, lr_warmup: int = 0,
          loss_included: bool = False) -> list[StepResult]:
    """Run `steps` optimizer steps of `forward(tokens) -> logits`; time each step to the device's end.

    loss_included: `forward(tokens, targets)` returns the loss itself (`with_loss`, compiled with the model).
    lr_warmup: the learning rate ramps linearly over the first lr_warmup steps, then stays at its value.
    """
    opt = optimizer or adamw(model.parameters(), lr, device)
    peak = [group["lr"] for group in opt.param_groups]
    results = []
    for i in range(steps):
        if i < lr_warmup:  # step lr_warmup - 1 reaches the peak, which then stays
            for group, top in zip(opt.param_groups, peak):
                group["lr"] = top * (i + 1) / lr_warmup
        inputs, targets = (t.to(device, non_blocking=True) for t in batches[i])
        synchronize(device)
        start = time.perf_counter()
        before = allocated_bytes(device)
        loss = forward(inputs, targets) if loss_included else next_token_loss(forward(inputs), targets)
        after = allocated_bytes(device)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        synchronize(device)
        r = StepResult(i, loss.item(), time.perf_counter() - start, before, after)
        results.append(r)
        if on_step:
            on_step(r)
    return results
