"""Expert-parallel variant of hf_style_moe, dispatching the way torchtitan's AllToAllTokenDispatcher does.

Each MoE layer keeps the HF module names (mlp.gate, mlp.experts, mlp.shared_experts) but
mlp.experts holds only this rank's slice of experts. Per layer the graph holds three
all-to-alls, the shapes a DeepEP pass has to recognise:

  1. token counts: in-place `torch.distributed.all_to_all_single(out, inp, group=...)`
     (count_exchange="c10d_inplace") or the functional collective
     (count_exchange="functional"); `.tolist()` of the counts gives the split sizes.
  2. dispatch: functional `all_to_all_single_autograd(tokens, out_splits, in_splits, group)`
     of expert-sorted token copies (one row per (token, expert) pair).
  3. combine: the same call with the splits swapped.
Routing weights are applied after the combine (fp32), then summed per token with index_add_.

Rows arrive rank-major (source rank, then local expert); they are put in expert-major
order for torch._grouped_mm and restored before the combine.

Import like hf_style_moe (folder on sys.path). Self-test (2 gloo ranks on 127.0.0.1):
`python tests/independent/ep_style_moe.py`.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

import hf_style_moe as hf


class ExpertParallelMoE(nn.Module):
    def __init__(self, cfg: hf.TinyDeepseekConfig, group: dist.ProcessGroup, count_exchange: str = "c10d_inplace"):
        super().__init__()
        if count_exchange not in ("c10d_inplace", "functional"):
            raise ValueError(f"count_exchange must be 'c10d_inplace' or 'functional', got {count_exchange!r}")
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        if cfg.n_routed_experts % self.ep_size:
            raise ValueError(f"{cfg.n_routed_experts} experts do not split over {self.ep_size} ranks")
        self.group = group
        self.count_exchange = count_exchange
        self.num_experts = cfg.n_routed_experts
        self.num_local_experts = cfg.n_routed_experts // self.ep_size
        self.gate = hf.TopkRouter(cfg)
        self.experts = hf.GroupedExperts(cfg, num_experts=self.num_local_experts)
        self.shared_experts = hf.SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def exchange_counts(self, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """[E] counts this rank sends -> [ep, E_local] counts each source rank sends here."""
        if self.count_exchange == "c10d_inplace":
            received = torch.empty_like(tokens_per_expert)
            dist.all_to_all_single(received, tokens_per_expert, group=self.group)
        else:
            received = funcol.all_to_all_single(tokens_per_expert, None, None, self.group)
        return received.view(self.ep_size, self.num_local_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weight = self.gate(x)
        routed = self.routed_experts(x.view(-1, x.shape[-1]), topk_idx, topk_weight)
        return routed.view(x.shape) + self.shared_experts(x)

    def routed_experts(self, tokens: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        top_k = topk_idx.shape[-1]
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        source_token = order // top_k
        # Experts are numbered rank-major, so sorting by expert also sorts by destination rank.
        send = tokens[source_token]
        tokens_per_expert = F.one_hot(flat_expert, self.num_experts).sum(dim=0)

        received_counts = self.exchange_counts(tokens_per_expert)
        input_splits = tokens_per_expert.view(self.ep_size, -1).sum(dim=1).tolist()
        output_splits = received_counts.sum(dim=1).tolist()

        received = funcol.all_to_all_single_autograd(send, output_splits, input_splits, self.group)

        # Rank-major (source rank, local expert) rows -> expert-major rows for the grouped GEMM.
        local_expert_of_block = torch.arange(self.num_local_experts, device=tokens.device).repeat(self.ep_size)
        local_expert_of_row = torch.repeat_interleave(
            local_expert_of_block, received_counts.reshape(-1), output_size=received.shape[0]
        )
        expert_major = torch.argsort(local_expert_of_row, stable=True)
        tokens_per_local_expert = received_counts.sum(dim=0)
        offsets = torch.cumsum(tokens_per_local_expert, dim=0, dtype=torch.int32)
        out = hf.grouped_swiglu(received[expert_major], self.experts.gate_up_proj, self.experts.down_proj, offsets)
        out = out[torch.argsort(expert_major)]

        returned = funcol.all_to_all_single_autograd(out, input_splits, output_splits, self.group)

        weighted = returned.float() * topk_weight.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros(tokens.shape, dtype=torch.float32, device=tokens.device).index_add_(0, source_token, weighted)
        return combined.to(tokens.dtype)


def shard_model(model: hf.DeepseekForCausalLM, group: dist.ProcessGroup, count_exchange: str = "c10d_inplace") -> hf.DeepseekForCausalLM:
    """Swap every DeepseekMoE for an ExpertParallelMoE holding this rank's experts (in place)."""
    for layer in model.model.layers:
        if not isinstance(layer.mlp, hf.DeepseekMoE):
            continue
        full = layer.mlp
        ep = ExpertParallelMoE(model.cfg, group, count_exchange)
        ep.gate = full.gate
        ep.shared_experts = full.shared_experts
        lo = ep.ep_rank * ep.num_local_experts
        hi = lo + ep.num_local_experts
        with torch.no_grad():
            ep.experts.gate_up_proj = nn.Parameter(full.experts.gate_up_proj[lo:hi].clone())
            ep.experts.down_proj = nn.Parameter(full.experts.down_proj[lo:hi].clone())
        layer.mlp = ep.to(full.experts.gate_up_proj.dtype)
    return model


def build_ep(group: dist.ProcessGroup, seed: int = 0, dtype: torch.dtype = torch.bfloat16, count_exchange: str = "c10d_inplace", **config_overrides) -> hf.DeepseekForCausalLM:
    """hf_style_moe.build(seed) with its experts sharded over `group`: same weights, same math."""
    return shard_model(hf.build(seed=seed, dtype=dtype, **config_overrides), group, count_exchange)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout_s: float = 120.0) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))


def all_to_all_single_packets() -> set:
    packets = {torch.ops._c10d_functional.all_to_all_single}
    if hasattr(torch.ops._c10d_functional_autograd, "all_to_all_single"):
        packets.add(torch.ops._c10d_functional_autograd.all_to_all_single)
    return packets


def _check_rank(rank: int, world_size: int, port: int) -> None:
    init_gloo(rank, world_size, port)
    group = dist.group.WORLD
    for count_exchange in ("c10d_inplace", "functional"):
        reference = hf.build(seed=0, dtype=torch.float32)
        sharded = build_ep(group, seed=0, dtype=torch.float32, count_exchange=count_exchange)
        ids = hf.example_input_ids(reference.cfg, seed=10 + rank)
        ref_loss = hf.loss_fn(reference, ids)
        ep_loss = hf.loss_fn(sharded, ids)
        ref_loss.backward()
        ep_loss.backward()
        torch.testing.assert_close(ep_loss, ref_loss, rtol=1e-5, atol=1e-5)
        for ref_layer, ep_layer in zip(reference.model.layers, sharded.model.layers):
            if not isinstance(ep_layer.mlp, ExpertParallelMoE):
                continue
            moe = ep_layer.mlp
            torch.testing.assert_close(moe.gate.weight.grad, ref_layer.mlp.gate.weight.grad, rtol=1e-4, atol=1e-6)
            lo, hi = moe.ep_rank * moe.num_local_experts, (moe.ep_rank + 1) * moe.num_local_experts
            for name in ("gate_up_proj", "down_proj"):
                # A local expert's gradient collects every rank's tokens.
                full_grad = getattr(ref_layer.mlp.experts, name).grad.clone()
                dist.all_reduce(full_grad, group=group)
                torch.testing.assert_close(getattr(moe.experts, name).grad, full_grad[lo:hi], rtol=1e-4, atol=1e-6)
        if rank == 0:
            print(f"{count_exchange}: EP loss/grads == single-process model ({world_size} ranks)")

    # this self-test process is the whole program: its capturing backend needs the split sizes as SymInts
    torch._dynamo.config.capture_scalar_outputs = True
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = build_ep(group, seed=0)
    ids = hf.example_input_ids(model.cfg, seed=10 + rank)
    torch.compile(hf.loss_fn, backend=capture, fullgraph=True)(model, ids).backward()
    # torch 2.11 traces all_to_all_single_autograd to _c10d_functional_autograd.all_to_all_single.
    a2a = [n for n in graphs[0].graph.nodes if n.target in all_to_all_single_packets()]
    moe_layers = sum(isinstance(layer.mlp, ExpertParallelMoE) for layer in model.model.layers)
    assert len(graphs) == 1 and len(a2a) == 3 * moe_layers, (len(graphs), len(a2a))
    if rank == 0:
        print(f"Dynamo: 1 graph, {len(a2a)} all_to_all_single nodes: {sorted({str(n.target) for n in a2a})}")
    dist.destroy_process_group()


def _self_test(world_size: int = 2) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_check_rank, args=(world_size, free_port()), nprocs=world_size, start_method="spawn")


if __name__ == "__main__":
    _self_test(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
