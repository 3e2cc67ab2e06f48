"""Expert-parallel MoE blocks in spellings tests/independent/ep_catalog.py does not hold, to stress the `deepep` pass.

Same API and conventions as ep_catalog (its EPBlock, full_weights and `reference` are reused): x [B, S, D] bf16,
top-k of E experts, rank r owns experts [r*E/ep, (r+1)*E/ep), SwiGLU experts with the same full weights. Every
block here is a numerically correct EP implementation (on every rank its output == `reference(block, x)`), drops
no slot, and is written after a public codebase:

  ArangeEqCountsSplitsFirst        Megatron-LM token dispatcher (counts by ids == arange(E), input splits to the host
                                   before the counts exchange, in-place c10d counts, sort(stable) + repeat_interleave,
                                   index_copy_ un-permute, scatter back to slots, view(T, K, D) * probs summed)
  IndexAddCountsWeightsBeforeDense DeepSpeed/Tutel-like: weights scale the rows on the sender, plain sum after as a
                                   dense one-hot combine matmul (einsum); counts by zeros(E).index_add_
  MegablocksSearchsortedAsync      Megablocks parallel_forward_once: local sort first, bins by searchsorted, async_op
                                   counts exchange + work.wait(), receiver expert ids by searchsorted(bins), inverse
                                   permutation by argsort, weighted combine as bmm(w[T,1,K], rows[T,K,D])
  MegablocksSearchsortedSync       the same with a blocking counts exchange (Dynamo graph-breaks on async_op=True)
  SequentialMLPSplitLoop           Megatron SequentialMLP: experts as a Python loop of F.linear over
                                   torch.split(rows, tokens_per_expert.tolist())
  PaddedCapacityBmm                receiver pads each local expert's rows into [E_l, C, D] (C a static bound: nothing
                                   dropped) and runs the experts as torch.bmm
  TransformersAllToAllEP           transformers 5's own AllToAllEP + grouped_mm_experts_forward, imported and run as is
  TransformersAllToAllEPNoEmptyBranch  the same minus AllToAllEP.__call__'s `if tokens.shape[0] == 0` (a graph break)
  DeepSpeedNoDropCapacityEinsum    DeepSpeed/GShard einsum dispatch into [E, C, D] with C = T*K (drop_tokens=False
                                   spelled statically) and equal-split all-to-alls inside an autograd.Function

DEEPEP_REGION says, per block, whether it is a DeepEP dispatch/combine region by what it computes (every slot sent
once, un-padded, and summed back per token) and why not when it is not.

API: CATALOG (name -> (cls, plain)), DEEPEP_REGION, build(name, group, dim, experts, top_k, seed); reference is
ep_catalog.reference. Probe: probe_ep_catalog_unseen.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ep_catalog import EPBlock, full_weights, reference  # noqa: F401  (reference: re-exported for the probe)


def _softmax_topk_renorm(block: EPBlock, x: torch.Tensor):
    probs = torch.softmax(F.linear(x.reshape(-1, block.dim), block.gate.weight).float(), dim=-1)
    weights, ids = torch.topk(probs, block.top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- (a)+(b) Megatron-LM token dispatcher


class ArangeEqCountsSplitsFirst(EPBlock):
    """counts (ids[T,K,1] == arange(E)).sum((0,1)); input splits .cpu().tolist() BEFORE the counts exchange; in-place dist.all_to_all_single into counts.new_empty(E); sort(stable) + arange(T).repeat_interleave(K)[order]; receiver sort(stable); index_copy_; scatter back to slots; view(T,K,D) * probs.unsqueeze(-1) summed over K."""

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        tokens = x.reshape(n, d)
        ids, probs = self.route(x)
        counts = (ids.unsqueeze(-1) == torch.arange(self.num_experts)).sum(dim=(0, 1))
        input_splits = counts.view(self.ep, -1).sum(dim=1).cpu().tolist()  # host sync before the exchange
        recv_counts = counts.new_empty(self.num_experts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        output_splits = recv_counts.view(self.ep, -1).sum(dim=1).cpu().tolist()
        _, order = torch.sort(ids.view(-1), stable=True)
        token_of_row = torch.arange(n).repeat_interleave(self.top_k)[order]
        recv = funcol.all_to_all_single_autograd(tokens[token_of_row], output_splits, input_splits, self.group)
        local_of_row = (torch.arange(self.num_experts) % self.local).repeat_interleave(
            recv_counts, output_size=recv.shape[0])
        _, perm = torch.sort(local_of_row, stable=True)
        tokens_per_expert = recv_counts.view(self.ep, -1).sum(dim=0)
        y = self.experts(recv[perm], tokens_per_expert.cumsum(0).to(torch.int32))
        back = torch.zeros_like(y)
        back.index_copy_(0, perm, y)
        ret = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        slots = torch.zeros_like(ret).scatter(0, order.unsqueeze(-1).expand(-1, d), ret)
        out = (slots.view(n, self.top_k, d).float() * probs.unsqueeze(-1)).sum(dim=1)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


# ---------------------------------------------------------------- (b)+(c) weights on the sender, dense combine


class IndexAddCountsWeightsBeforeDense(EPBlock):
    """counts zeros(E).index_add_(0, ids, ones); funcol counts a2a + wait; splits by int() over a tensor's rows; rows scaled by their routing weight on the SENDER; receiver perm = argsort of local ids; un-permute by index_put; plain sum after as one_hot(token, T)^T @ rows (einsum 'rt,rd->td'); no shared expert."""

    weights_before = True
    has_shared = False

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        ids, w = self.route(x)
        flat = ids.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int64).index_add_(0, flat, torch.ones_like(flat))
        recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        input_splits = [int(c) for c in counts.view(self.ep, -1).sum(1)]
        output_splits = [int(c) for c in recv_counts.view(self.ep, -1).sum(1)]
        order = flat.argsort(stable=True)
        token_of_row = order // self.top_k
        send = (x.reshape(n, d)[token_of_row].float() * w.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        recv = funcol.all_to_all_single_autograd(send, output_splits, input_splits, self.group)
        local_of_row = torch.arange(self.local).repeat(self.ep).repeat_interleave(recv_counts,
                                                                                  output_size=recv.shape[0])
        perm = local_of_row.argsort(stable=True)
        y = self.experts(recv[perm], recv_counts.view(self.ep, -1).sum(0).cumsum(0).to(torch.int32))
        back = torch.zeros_like(y).index_put((perm,), y)
        ret = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        combine = F.one_hot(token_of_row, n).float()  # [T*K, T]: GShard's combine tensor, weights already applied
        out = torch.einsum("rt,rd->td", combine, ret.float())
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


# ---------------------------------------------------------------- (e) Megablocks parallel_forward_once


class MegablocksSearchsortedAsync(EPBlock):
    """local sort first; bins = searchsorted(sorted ids, arange(E), right) and counts = bins.diff; counts exchange dist.all_to_all_single(async_op=True) + work.wait(); .cpu() then host sums; receiver expert of row = (arange(E) % E_l)[searchsorted(cumsum(counts), arange(R), right)]; sort(stable); index_put_ un-permute; slot order restored by ret[argsort(indices)]; combine bmm(w[T,1,K], rows[T,K,D]); sigmoid router."""

    def route(self, x):
        scores = torch.sigmoid(F.linear(x.reshape(-1, self.dim), self.gate.weight).float())
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    async_counts = True  # Megablocks' own spelling; Dynamo graph-breaks on async_op=True and Work.wait()

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        ids, expert_weights = self.route(x)
        bin_ids, indices = torch.sort(ids.flatten(), stable=True)
        bins = torch.searchsorted(bin_ids, torch.arange(self.num_experts), right=True)  # inclusive cumsum
        tokens_per_expert = torch.diff(bins, prepend=bins.new_zeros(1))
        parallel_tokens_per_expert = torch.empty_like(tokens_per_expert)
        work = dist.all_to_all_single(parallel_tokens_per_expert, tokens_per_expert, group=self.group,
                                      async_op=self.async_counts)
        x_sorted = x.reshape(n, d)[indices // self.top_k]  # local permutation while the counts are in flight
        if work is not None:
            work.wait()
        send_host = tokens_per_expert.view(self.ep, -1).cpu()
        recv_host = parallel_tokens_per_expert.view(self.ep, -1).cpu()
        input_splits = send_host.sum(dim=-1).tolist()
        output_splits = recv_host.sum(dim=-1).tolist()
        parallel_x = funcol.all_to_all_single_autograd(x_sorted, output_splits, input_splits, self.group)
        replicate_bins = parallel_tokens_per_expert.flatten().cumsum(0)
        rows = torch.arange(parallel_x.shape[0])
        parallel_top_expert = (torch.arange(self.num_experts) % self.local)[
            torch.searchsorted(replicate_bins, rows, right=True)]
        _, parallel_indices = torch.sort(parallel_top_expert, stable=True)
        parallel_bins = parallel_tokens_per_expert.view(self.ep, -1).sum(0).cumsum(0)
        y = self.experts(parallel_x[parallel_indices], parallel_bins.to(torch.int32))
        unpermuted = torch.empty_like(y).index_put_((parallel_indices,), y)
        ret = funcol.all_to_all_single_autograd(unpermuted, input_splits, output_splits, self.group)
        slots = ret[torch.argsort(indices)]  # slot (token * K + k) order
        out = torch.bmm(expert_weights.view(n, 1, self.top_k), slots.view(n, self.top_k, d).float()).squeeze(1)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class MegablocksSearchsortedSync(MegablocksSearchsortedAsync):
    """MegablocksSearchsortedAsync with a blocking counts exchange (async_op=False), the rest unchanged."""

    async_counts = False


# ---------------------------------------------------------------- (d) experts as a loop over local experts


class SequentialMLPSplitLoop(EPBlock):
    """Megatron SequentialMLP experts: torch.split(rows, tokens_per_expert.tolist()) and a Python loop of F.linear per local expert, then torch.cat (no _grouped_mm); one_hot counts; funcol + wait; .tolist(); argsort(stable); index_copy; index_add_."""

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def sequential_experts(self, rows, tokens_per_expert):
        chunks = torch.split(rows, tokens_per_expert.tolist())
        outs = [F.linear(F.silu(F.linear(c, self.w1[e])) * F.linear(c, self.w3[e]), self.w2[e])
                for e, c in enumerate(chunks)]
        return torch.cat(outs, dim=0)

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        ids, w = self.route(x)
        flat = ids.reshape(-1)
        counts = F.one_hot(flat, self.num_experts).sum(0)  # bincount's length is data-dependent under Dynamo
        recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        input_splits = counts.view(self.ep, -1).sum(1).tolist()
        output_splits = recv_counts.view(self.ep, -1).sum(1).tolist()
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        recv = funcol.all_to_all_single_autograd(x.reshape(n, d)[token], output_splits, input_splits, self.group)
        local_of_row = torch.arange(self.local).repeat(self.ep).repeat_interleave(recv_counts,
                                                                                  output_size=recv.shape[0])
        perm = torch.argsort(local_of_row, stable=True)
        y = self.sequential_experts(recv[perm], recv_counts.view(self.ep, -1).sum(0))
        back = torch.zeros_like(y).index_copy(0, perm, y)
        ret = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        out = torch.zeros(n, d, dtype=torch.float32).index_add_(0, token, ret.float() * w.reshape(-1)[order, None])
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


# ---------------------------------------------------------------- (d) padded capacity on the receiver, torch.bmm


class PaddedCapacityBmm(EPBlock):
    """Receiver lays each received row at (local expert, position) of a zero [E_l, C, D] buffer, C = ep*T*K (a static bound: nothing dropped); experts as torch.bmm with stacked weights; rows read back from their positions; one_hot counts; funcol + wait; .tolist(); index_add_."""

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        capacity = self.ep * n * self.top_k  # every rank sends at most n*K rows (same batch shape on every rank)
        ids, w = self.route(x)
        flat = ids.reshape(-1)
        counts = F.one_hot(flat, self.num_experts).sum(0)
        recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        input_splits = counts.view(self.ep, -1).sum(1).tolist()
        output_splits = recv_counts.view(self.ep, -1).sum(1).tolist()
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        recv = funcol.all_to_all_single_autograd(x.reshape(n, d)[token], output_splits, input_splits, self.group)
        rows = recv.shape[0]
        segment = torch.arange(self.num_experts).repeat_interleave(recv_counts, output_size=rows)  # (rank, local)
        position = torch.arange(rows) - (recv_counts.cumsum(0) - recv_counts)[segment]
        per_rank = recv_counts.view(self.ep, self.local)
        earlier_ranks = (per_rank.cumsum(0) - per_rank).reshape(-1)  # same expert's rows from lower ranks
        slot = (segment % self.local) * capacity + earlier_ranks[segment] + position
        padded = recv.new_zeros(self.local * capacity, d).index_copy(0, slot, recv).view(self.local, capacity, d)
        h = F.silu(torch.bmm(padded, self.w1.transpose(1, 2))) * torch.bmm(padded, self.w3.transpose(1, 2))
        y = torch.bmm(h, self.w2.transpose(1, 2)).reshape(self.local * capacity, d)[slot]  # received order
        ret = funcol.all_to_all_single_autograd(y, input_splits, output_splits, self.group)
        out = torch.zeros(n, d, dtype=torch.float32).index_add_(0, token, ret.float() * w.reshape(-1)[order, None])
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


# ---------------------------------------------------------------- (e) transformers 5's own EP, run as is


class _GroupMesh:
    """The three DeviceMesh methods AllToAllEP calls, over a plain process group (a 1-D mesh stand-in)."""

    def __init__(self, group):
        self.group = group

    def get_group(self):
        return self.group

    def size(self):
        return dist.get_world_size(self.group)

    def get_local_rank(self):
        return dist.get_rank(self.group)


class _ExpertsConfig:
    _experts_implementation = "grouped_mm"


def _hf_experts_class():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class HFExperts(nn.Module):
        """An HF experts module (gate_up_proj [E_l, 2I, D], down_proj [E_l, D, I]) as MoEParamShard leaves it."""

        def __init__(self, config, gate_up_proj, down_proj):
            super().__init__()
            self.num_experts = gate_up_proj.shape[0]
            self.gate_up_proj = nn.Parameter(gate_up_proj)
            self.down_proj = nn.Parameter(down_proj)
            self.act_fn = F.silu

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError("dispatched through config._experts_implementation")

    return HFExperts


class TransformersAllToAllEP(EPBlock):
    """transformers.distributed.expert_parallel.AllToAllEP (counts [ep, E_l] by scatter_add_, in-place counts a2a, stack(...).tolist(), argsort (unstable), _WaitTensor autograd.Function, per-row local expert ids repeat_interleave'd from the counts, experts = transformers.integrations.moe.grouped_mm_experts_forward (sort, histc, inverse perm, view(R,1,D).sum), slots by buf[order] = rows, view(T,K,D) * w summed)."""

    fused_experts = True
    has_shared = False

    def __init__(self, group, full, top_k):
        super().__init__(group, full, top_k)
        from transformers.distributed.expert_parallel import AllToAllEP

        experts = _hf_experts_class()(_ExpertsConfig(), self.gate_up_proj.data, self.down_proj.data)
        experts._is_expert_parallel = True  # as MoEParamShard(shards_expert_dim=True) marks sharded experts
        del self.gate_up_proj, self.down_proj
        self.hf_experts = experts  # its parameters are this rank's experts (the names differ from ep_catalog's)
        # tp size 1: every rank creates every singleton group (new_group is collective), then keeps its own
        singletons = [dist.new_group([r]) for r in range(self.ep)]
        self.all_to_all = AllToAllEP(experts, ep_mesh=_GroupMesh(group), tp_mesh=_GroupMesh(singletons[self.rank]))

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def forward(self, x):
        b, s, d = x.shape
        ids, w = self.route(x)
        out = self.all_to_all(x.reshape(b * s, d), ids, w)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class TransformersAllToAllEPNoEmptyBranch(TransformersAllToAllEP):
    """TransformersAllToAllEP with AllToAllEP.__call__'s `if tokens.shape[0] == 0` branch dropped (Dynamo graph-breaks on that data-dependent test); HF's _dispatch_tokens, grouped_mm_experts_forward and _combine_tokens run unchanged."""

    def forward(self, x):
        b, s, d = x.shape
        ids, w = self.route(x)
        ep = self.all_to_all
        tokens, expert_ids, weights, state = ep._dispatch_tokens(x.reshape(b * s, d), ids, w)
        out = ep._combine_tokens(ep.experts_forward(tokens, expert_ids, weights), state)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


# ---------------------------------------------------------------- (e) DeepSpeed/GShard capacity einsum, no drops


class EqualSplitAllToAll(torch.autograd.Function):
    """DeepSpeed's `_AllToAll`: dist.all_to_all_single(output, input) with equal splits; backward is the same."""

    @staticmethod
    def forward(ctx, group, input):
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, grad):
        return None, EqualSplitAllToAll.apply(ctx.group, grad)


class DeepSpeedNoDropCapacityEinsum(EPBlock):
    """GShard/DeepSpeed top-k gating with capacity C = T*K (no slot can be dropped): locations by cumsum of the one-hot mask, dispatch einsum 'sec,sm->ecm' into [E, C, D], equal-split all-to-all inside an autograd.Function, local experts as bmm over [E_l, ep*C, D], all-to-all back, combine einsum 'sec,ecm->sm' with the routing weights."""

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        capacity = n * self.top_k
        ids, w = self.route(x)
        mask = F.one_hot(ids, self.num_experts)  # [T, K, E]
        # slot (t, k)'s position among its expert's slots, token-major (GShard's locations)
        locations = (mask.reshape(n * self.top_k, -1).cumsum(0).reshape(n, self.top_k, -1) - 1) * mask
        position = F.one_hot(locations.sum(-1), capacity)  # [T, K, C]
        dispatch = (mask.unsqueeze(-1) * position.unsqueeze(2)).sum(1)  # [T, E, C] 0/1
        combine_weights = (w.unsqueeze(-1).unsqueeze(-1) * mask.unsqueeze(-1) * position.unsqueeze(2)).sum(1)
        dispatched = torch.einsum("sec,sm->ecm", dispatch.to(x.dtype), x.reshape(n, d))
        received = EqualSplitAllToAll.apply(self.group, dispatched)  # [ep * E_l, C, D]: sender-major
        rows = received.reshape(self.ep, self.local, capacity, d).transpose(0, 1).reshape(self.local, -1, d)
        h = F.silu(torch.bmm(rows, self.w1.transpose(1, 2))) * torch.bmm(rows, self.w3.transpose(1, 2))
        y = torch.bmm(h, self.w2.transpose(1, 2))
        y = y.reshape(self.local, self.ep, capacity, d).transpose(0, 1).reshape(self.num_experts, capacity, d)
        returned = EqualSplitAllToAll.apply(self.group, y)
        out = torch.einsum("sec,ecm->sm", combine_weights, returned.float())
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


CATALOG: dict[str, tuple[type[EPBlock], bool]] = {
    cls.__name__: (cls, True) for cls in (
        ArangeEqCountsSplitsFirst, IndexAddCountsWeightsBeforeDense, MegablocksSearchsortedAsync,
        MegablocksSearchsortedSync, SequentialMLPSplitLoop, PaddedCapacityBmm, TransformersAllToAllEP,
        TransformersAllToAllEPNoEmptyBranch, DeepSpeedNoDropCapacityEinsum)
}

DEEPEP_REGION: dict[str, tuple[bool, str]] = {
    "ArangeEqCountsSplitsFirst": (True, "every slot sent once, summed back with weights after"),
    "IndexAddCountsWeightsBeforeDense": (True, "weights before the experts (on the sender), plain sum after"),
    "MegablocksSearchsortedAsync": (True, "every slot sent once, weighted sum after"),
    "MegablocksSearchsortedSync": (True, "every slot sent once, weighted sum after"),
    "SequentialMLPSplitLoop": (True, "dispatch/combine as DeepEP; only the experts are spelled as a loop"),
    "PaddedCapacityBmm": (True, "dispatch/combine as DeepEP; the padding is local to the receiver's experts"),
    "TransformersAllToAllEP": (True, "every slot sent once, weighted sum after"),
    "TransformersAllToAllEPNoEmptyBranch": (True, "every slot sent once, weighted sum after"),
    "DeepSpeedNoDropCapacityEinsum": (False, "sends E*C capacity rows with equal splits, zero padding included, "
                                             "and has no counts exchange: equal results, not DeepEP's data layout"),
}


def build(name: str, group: dist.ProcessGroup, dim: int = 64, experts: int = 8, top_k: int = 2,
          seed: int = 0) -> EPBlock:
    """The block `name` holding this rank's experts of one full init (identical on every rank)."""
    cls, _ = CATALOG[name]
    return cls(group, full_weights(dim, experts, seed), top_k)
