"""This process's place in a torchrun job, and the gradient averaging a data-parallel step needs across it."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from .train import adamw


@dataclasses.dataclass
class Ranks:
    """This process's place in a torchrun job (a single process is rank 0 of 1, with no group)."""

    rank: int = 0
    world: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    group: object = None  # the default process group under torchrun

    @classmethod
    def from_env(cls, device: str) -> "Ranks":
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dev = torch.device(device)
        if world == 1:
            return cls(device=dev)
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if dev.type == "cuda":
            dev = torch.device("cuda", local)
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dev, dist.group.WORLD)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks (a step lasts as long as its slowest rank)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def sharded_params(model: torch.nn.Module) -> set[int]:
    """ids of parameters that live on one rank only (expert weights under EP): never all-reduced."""
    return {id(p) for m in model.modules() if getattr(m, "ep_size", 1) > 1 for p in m.parameters(recurse=False)}


class AllReduceGradsOptimizer:
    """AdamW whose step first averages the replicated weights' gradients over ranks, in one bucket (as DDP)."""

    def __init__(self, model: torch.nn.Module, lr: float, ranks: Ranks):
        self.inner = adamw(model.parameters(), lr, ranks.device)
        sharded = sharded_params(model)
        self.replicated = [p for p in model.parameters() if id(p) not in sharded and p.requires_grad]
        self.ranks = ranks

    def step(self) -> None:
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if grads and self.ranks.world > 1:
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat)
            flat.div_(self.ranks.world)
            for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(synced)
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:  # what an lr schedule adjusts
        return self.inner.param_groups
