"""A catalog of expert-parallel MoE blocks, each spelled the way a different engineer would write it.

Used to check that the `deepep` pass recognises EP dispatch/combine regions by what they compute,
not by how they are spelled. Every block takes x [B, S, D] (bf16), routes each token to top-k of E
experts, sends one row per (token, expert) slot to the rank owning that expert (rank r owns the
contiguous experts [r*E/ep, (r+1)*E/ep)), runs its local experts with torch._grouped_mm on int32
cumulative offsets, sends the rows back and sums them per token. Three all_to_all_single calls per
block: counts, tokens, tokens back.

Plain blocks (CATALOG[name][1] is True) are numerically correct EP implementations: on every rank
their output equals `reference(block, x)`, the same block computed without EP (all experts local).
The non-plain blocks are documented EP spellings a DeepEP rewrite must NOT accept: each is
self-consistent (it equals its own reference) but computes something DeepEP's dispatch/combine
does not (drops slots, sends padding rows, averages).

API: CATALOG, build(name, group, dim, experts, top_k, seed), reference(block, x).
Import with this folder on sys.path (`import ep_catalog`). Self-test: probe_ep_catalog.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- shared plumbing (weights, experts)


def full_weights(dim: int, experts: int, seed: int) -> dict[str, torch.Tensor]:
    """Every rank draws the same full set of weights; each block slices its local experts from it."""
    gen = torch.Generator().manual_seed(seed)
    inter = dim // 2

    def draw(*shape):
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(torch.bfloat16)

    return {"gate": draw(experts, dim), "w1": draw(experts, inter, dim), "w3": draw(experts, inter, dim),
            "w2": draw(experts, dim, inter), "s1": draw(inter, dim), "s3": draw(inter, dim), "s2": draw(dim, inter)}


def experts_separate(rows, w1, w3, w2, offs):
    """SwiGLU experts with w1/w3 [E_l, I, D] and w2 [E_l, D, I] (torchtitan layout)."""
    gate = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(rows, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def experts_fused(rows, gate_up, down, offs):
    """SwiGLU experts with a fused gate_up [E_l, 2I, D] and down [E_l, D, I] (HF layout)."""
    gate, up = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)


class SharedMLP(nn.Module):
    def __init__(self, full):
        super().__init__()
        inter, dim = full["s1"].shape
        self.gate_proj = nn.Linear(dim, inter, bias=False, dtype=torch.bfloat16)
        self.up_proj = nn.Linear(dim, inter, bias=False, dtype=torch.bfloat16)
        self.down_proj = nn.Linear(inter, dim, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            for lin, key in ((self.gate_proj, "s1"), (self.up_proj, "s3"), (self.down_proj, "s2")):
                lin.weight.copy_(full[key])

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EPBlock(nn.Module):
    """Holds the group, sizes and weights; subclasses write route() and the EP forward() their own way.

    The class attributes say what the block computes, for `reference`.
    """

    fused_experts = False  # gate_up/down parameters instead of w1/w3/w2
    has_shared = True
    weights_before = False  # routing weights scale the rows sent, not the rows returned
    combine = "sum"  # how a token's K returned rows are reduced: "sum" or "mean"
    capacity = None  # rows per (source rank, expert) kept; None keeps every slot

    def __init__(self, group: dist.ProcessGroup, full: dict[str, torch.Tensor], top_k: int):
        super().__init__()
        self.group = group
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts, self.dim = full["gate"].shape
        if self.num_experts % self.ep:
            raise ValueError(f"{self.num_experts} experts do not split over {self.ep} ranks")
        self.local = self.num_experts // self.ep
        self.top_k = top_k
        self.full_weights = full  # a plain attribute: `reference` reads it, forward never does
        lo, hi = self.rank * self.local, (self.rank + 1) * self.local
        self.gate = nn.Linear(self.dim, self.num_experts, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            self.gate.weight.copy_(full["gate"])
        if self.fused_experts:
            self.gate_up_proj = nn.Parameter(torch.cat([full["w1"], full["w3"]], dim=1)[lo:hi].clone())
            self.down_proj = nn.Parameter(full["w2"][lo:hi].clone())
        else:
            self.w1 = nn.Parameter(full["w1"][lo:hi].clone())
            self.w3 = nn.Parameter(full["w3"][lo:hi].clone())
            self.w2 = nn.Parameter(full["w2"][lo:hi].clone())
        self.shared_experts = SharedMLP(full) if self.has_shared else None

    def experts(self, rows, offs):
        if self.fused_experts:
            return experts_fused(rows, self.gate_up_proj, self.down_proj, offs)
        return experts_separate(rows, self.w1, self.w3, self.w2, offs)

    def with_shared(self, routed, x):
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


# ---------------------------------------------------------------- a custom scatter-add op (torchtitan style)


def _define_scatter_add_rows():
    if hasattr(torch.ops.ep_catalog, "scatter_add_rows"):  # imported twice under two module names
        return torch.ops.ep_catalog.scatter_add_rows

    @torch.library.custom_op("ep_catalog::scatter_add_rows", mutates_args=())
    def scatter_add_rows(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """out.scatter_add(0, index, src) behind an opaque op (like torchtitan::deterministic_scatter_add)."""
        return out.scatter_add(0, index, src)

    @scatter_add_rows.register_fake
    def _(out, index, src):
        return torch.empty_like(out)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return grad, None, grad.gather(0, index)

    scatter_add_rows.register_autograd(backward, setup_context=setup_context)
    return torch.ops.ep_catalog.scatter_add_rows


scatter_add_rows = _define_scatter_add_rows()


# ---------------------------------------------------------------- Megatron's all-to-all autograd.Function


class MegatronAllToAll(torch.autograd.Function):
    """Megatron-LM `_AllToAll`: in-place dist.all_to_all_single; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        input = input.contiguous()
        if output_split_sizes is None:
            output = torch.empty_like(input)
        else:
            output = input.new_empty(size=[sum(output_split_sizes)] + list(input.size()[1:]))
        dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, *grad_output):
        return (None, MegatronAllToAll.apply(ctx.group, *grad_output, ctx.input_split_sizes, ctx.output_split_sizes),
                None, None)


# ---------------------------------------------------------------- plain blocks


class OneHotTolistIndexAdd(EPBlock):
    """1-D counts from one_hot(ids[T,K]).sum(0); funcol a2a + explicit wait; .tolist(); argsort(stable); index_copy; index_add_; softmax; weights after."""

    fused_experts = True

    def route(self, x):
        probs = F.linear(x.flatten(0, 1).float(), self.gate.weight.float()).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        tokens = x.view(-1, d)
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_of_row = order // self.top_k
        counts = F.one_hot(flat, self.num_experts).sum(dim=0)
        received_counts = funcol.all_to_all_single(counts, None, None, self.group)
        received_counts = funcol.wait_tensor(received_counts)
        input_splits = counts.view(self.ep, -1).sum(dim=1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(dim=1).tolist()
        received = funcol.all_to_all_single_autograd(tokens[token_of_row], output_splits, input_splits, self.group)
        local_id = torch.arange(self.local).repeat(self.ep).repeat_interleave(received_counts)
        perm = torch.argsort(local_id, stable=True)
        offs = received_counts.view(self.ep, -1).sum(dim=0).cumsum(dim=0).to(torch.int32)
        y = self.experts(received[perm], offs)
        back = torch.zeros_like(y).index_copy(0, perm, y)
        returned = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        rows = returned.float() * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(b * s, d, dtype=torch.float32).index_add_(0, token_of_row, rows)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class TorchtitanLike2DCounts(EPBlock):
    """Counts [ep, E/ep] (splits None) from histc(float) of ids[B,S,K]; double wait_tensor; .to('cpu').tolist(); segment-arithmetic permute; buf[perm, :] = y; custom scatter_add_rows op; sigmoid; weights after (bf16 product)."""

    def route(self, x):
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        top_scores, ids = torch.topk(scores, k=self.top_k, dim=-1)
        return ids, top_scores / top_scores.sum(dim=-1, keepdim=True)

    def _permute(self, routed_input, counts_group):
        # torchtitan's rank-major -> expert-major reorder: segment starts from cumsums, ids by repeat_interleave
        flat = counts_group.reshape(-1)
        total = flat.sum()
        input_starts = (flat.cumsum(0) - flat).view(self.ep, self.local)
        segment_lens = counts_group.t().reshape(-1)
        input_starts = input_starts.t().reshape(-1)
        seg_ids = torch.arange(segment_lens.shape[0]).repeat_interleave(segment_lens)
        output_starts = segment_lens.cumsum(0) - segment_lens
        permuted_indices = input_starts[seg_ids] + torch.arange(total) - output_starts[seg_ids]
        return routed_input.shape, routed_input[permuted_indices, :], permuted_indices, counts_group.sum(0)

    def forward(self, x):
        bs, slen, dim = x.shape
        selected_experts_indices, top_scores = self.route(x)
        num_tokens_per_expert = torch.histc(selected_experts_indices.float(), bins=self.num_experts, min=0,
                                            max=self.num_experts).to(torch.int64)
        with torch.no_grad():
            counts_group = funcol.all_to_all_single(num_tokens_per_expert.view(self.ep, -1), None, None, self.group)
            counts_group = torch.ops._c10d_functional.wait_tensor(counts_group)
            counts_group = torch.ops._c10d_functional.wait_tensor(counts_group)
            input_splits = num_tokens_per_expert.view(self.ep, -1).sum(dim=1).to(torch.device("cpu")).tolist()
            output_splits = counts_group.sum(dim=1).to("cpu").tolist()
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        token_indices_experts_sorted = token_indices_experts_sorted // self.top_k
        routed_input = x.view(-1, dim)[token_indices_experts_sorted]
        routed_input = funcol.all_to_all_single_autograd(routed_input, output_splits, input_splits, self.group)
        input_shape, routed_input, permuted_indices, tokens_per_local_expert = self._permute(routed_input, counts_group)
        offs = torch.cumsum(tokens_per_local_expert, dim=0, dtype=torch.int32)
        routed_output = self.experts(routed_input, offs)
        out_unpermuted = routed_output.new_empty(input_shape)
        out_unpermuted[permuted_indices, :] = routed_output
        routed_output = funcol.all_to_all_single_autograd(out_unpermuted, input_splits, output_splits, self.group)
        routed_output = (routed_output.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        out = scatter_add_rows(torch.zeros_like(x.view(-1, dim)),
                               token_indices_experts_sorted.reshape(-1, 1).expand(-1, dim), routed_output)
        return self.with_shared(out.view(bs, slen, dim), x)


class BincountItemIndexPut(EPBlock):
    """1-D counts from bincount(ids[T,K]); in-place dist.all_to_all_single counts; per-element .item(); torch.sort; scatter un-permute; index_put_(accumulate=True); softmax without renorm; no shared expert."""

    has_shared = False

    def route(self, x):
        probs = F.softmax(self.gate(x.flatten(0, 1)).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, weights

    def forward(self, x):
        h = x.flatten(0, 1)
        ids, weights = self.route(x)
        flat = ids.flatten()
        _, order = torch.sort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send_per_rank = counts.view(self.ep, self.local).sum(-1)
        recv_per_rank = received_counts.view(self.ep, self.local).sum(-1)
        input_splits = [send_per_rank[i].item() for i in range(self.ep)]
        output_splits = [recv_per_rank[i].item() for i in range(self.ep)]
        received = funcol.all_to_all_single_autograd(h[order // self.top_k], output_splits, input_splits, self.group)
        expert_of_row = (torch.arange(self.num_experts) % self.local).repeat_interleave(
            received_counts, output_size=received.shape[0])
        _, perm = torch.sort(expert_of_row, stable=True)
        local_counts = received_counts.view(self.ep, self.local).sum(0)
        y = self.experts(received[perm], torch.cumsum(local_counts, 0, dtype=torch.int32))
        back = torch.zeros_like(y).scatter(0, perm.unsqueeze(1).expand(-1, y.shape[1]), y)
        returned = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        combined = torch.zeros(h.shape, dtype=torch.float32)
        combined.index_put_((order // self.top_k,), returned.float() * weights.flatten()[order].unsqueeze(1),
                            accumulate=True)
        return self.with_shared(combined.to(x.dtype).view_as(x), x)


class MegatronAutogradFunction(EPBlock):
    """1-D counts from zeros.scatter_add_(ids[T,K]).sum(0); in-place counts a2a; .cpu().tolist(); tokens via autograd.Function (in-place a2a inside); index_select send; argsort(stable); index_copy_; scatter_add_ with expanded index; topk-then-softmax router."""

    def route(self, x):
        logits = self.gate(x.view(-1, self.dim)).float()
        scores, top_indices = torch.topk(logits, k=self.top_k, dim=1)
        return top_indices, torch.softmax(scores, dim=-1, dtype=torch.float32)

    def forward(self, x):
        hidden_states = x.view(-1, self.dim)
        indices, probs = self.route(x)
        num_tokens = hidden_states.shape[0]
        counts = torch.zeros(num_tokens, self.num_experts, dtype=torch.long)
        counts.scatter_add_(1, indices, torch.ones_like(indices))
        num_local_tokens_per_expert = counts.sum(dim=0)
        num_global_tokens_per_expert = torch.empty_like(num_local_tokens_per_expert)
        dist.all_to_all_single(num_global_tokens_per_expert, num_local_tokens_per_expert, group=self.group)
        input_splits = num_local_tokens_per_expert.reshape(self.ep, self.local).sum(axis=1).cpu().tolist()
        output_splits = num_global_tokens_per_expert.reshape(self.ep, self.local).sum(axis=1).cpu().tolist()
        sorted_indices = torch.argsort(indices.view(-1), stable=True)
        permuted = hidden_states.index_select(0, sorted_indices // self.top_k)
        global_input = MegatronAllToAll.apply(self.group, permuted, output_splits, input_splits)
        expert_ids = (torch.arange(self.num_experts) % self.local).repeat_interleave(num_global_tokens_per_expert)
        sort_by_expert = torch.argsort(expert_ids, stable=True)
        tokens_per_expert = num_global_tokens_per_expert.reshape(self.ep, self.local).sum(axis=0)
        y = self.experts(global_input[sort_by_expert], tokens_per_expert.cumsum(0).to(torch.int32))
        restored = torch.zeros_like(y)
        restored.index_copy_(0, sort_by_expert, y)
        returned = MegatronAllToAll.apply(self.group, restored, input_splits, output_splits)
        weighted = returned.float() * probs.view(-1)[sorted_indices].unsqueeze(1)
        output = torch.zeros(num_tokens, self.dim, dtype=torch.float32)
        output.scatter_add_(0, (sorted_indices // self.top_k).unsqueeze(1).expand(-1, self.dim), weighted)
        return self.with_shared(output.to(x.dtype).view_as(x), x)


class DeepSeekWeightsBefore(EPBlock):
    """Counts from zeros(bool).scatter_(-1, ids[B,S,K], True).sum(dim=(0,1)); funcol counts a2a (implicit wait); .tolist(); weights applied BEFORE the experts; argsort(stable); buf[perm] = y; torch.index_add; sigmoid + renorm."""

    fused_experts = True
    weights_before = True

    def route(self, x):
        scores = self.gate(x).float().sigmoid()
        topk_weight, topk_idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return topk_idx, topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)

    def forward(self, x):
        bsz, seq, hidden = x.shape
        topk_idx, topk_weight = self.route(x)
        hit = torch.zeros(bsz, seq, self.num_experts, dtype=torch.bool).scatter_(-1, topk_idx, True)
        tokens_per_expert = hit.sum(dim=(0, 1))
        gathered = funcol.all_to_all_single(tokens_per_expert, None, None, self.group)
        send_sizes = tokens_per_expert.view(self.ep, -1).sum(1).tolist()
        recv_sizes = gathered.view(self.ep, -1).sum(1).tolist()
        order = topk_idx.flatten().argsort(stable=True)
        token = order // self.top_k
        scaled = (x.reshape(-1, hidden)[token].float() * topk_weight.flatten()[order, None]).to(x.dtype)
        received = funcol.all_to_all_single_autograd(scaled, recv_sizes, send_sizes, self.group)
        local_expert = torch.arange(self.local).repeat(self.ep).repeat_interleave(gathered,
                                                                                  output_size=received.shape[0])
        perm = local_expert.argsort(stable=True)
        offs = gathered.view(self.ep, -1).sum(0).cumsum(0).int()
        y = self.experts(received[perm], offs)
        unsorted = torch.empty_like(y)
        unsorted[perm] = y
        returned = funcol.all_to_all_single_autograd(unsorted, send_sizes, recv_sizes, self.group)
        out = torch.index_add(torch.zeros(bsz * seq, hidden, dtype=torch.float32), 0, token, returned.float())
        return self.with_shared(out.to(x.dtype).view(bsz, seq, hidden), x)


class SlotOrderReshapeSum(EPBlock):
    """int32 counts from zeros(int).scatter_(-1, ids[T,K], 1).sum(0); funcol counts a2a (no explicit wait); .tolist(); rows sent = repeat_interleave(x)[order]; argsort (not stable); torch.index_copy; sort undone then view(T, K, D) * w summed over K."""

    def route(self, x):
        logits = self.gate(x.reshape(-1, self.dim)).float()
        weights, ids = logits.softmax(-1).topk(self.top_k)
        return ids, weights / weights.sum(-1, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        n = b * s
        ids, w = self.route(x)
        counts = torch.zeros(n, self.num_experts, dtype=torch.int32).scatter_(-1, ids, 1).sum(0, dtype=torch.int32)
        recv_counts = funcol.all_to_all_single(counts, None, None, self.group)
        in_splits = counts.view(self.ep, self.local).sum(1).tolist()
        out_splits = recv_counts.view(self.ep, self.local).sum(1).tolist()
        order = ids.view(-1).argsort(stable=True)
        send = x.reshape(n, d).repeat_interleave(self.top_k, dim=0)[order]
        recv = funcol.all_to_all_single_autograd(send, out_splits, in_splits, self.group)
        local_ids = (torch.arange(self.num_experts) % self.local).repeat_interleave(recv_counts.long(),
                                                                                    output_size=recv.shape[0])
        perm = torch.argsort(local_ids)
        y = self.experts(recv[perm], recv_counts.view(self.ep, self.local).sum(0).cumsum(0).int())
        back = torch.index_copy(torch.empty_like(y), 0, perm, y)
        ret = funcol.all_to_all_single_autograd(back, in_splits, out_splits, self.group)
        slots = torch.empty_like(ret)
        slots[order] = ret
        out = (slots.view(n, self.top_k, d).float() * w.unsqueeze(-1)).sum(dim=1)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class Compact2DOneHotSortIndexSelect(EPBlock):
    """Counts [ep, E/ep] from one_hot(ids[B,S,K]).sum(dim=(0,1,2)); funcol a2a + explicit wait; .tolist(); torch.sort (not stable); index_select gathers; in-place scatter_ un-permute; index_add_; softmax without renorm; no shared expert."""

    has_shared = False
    fused_experts = True

    def route(self, x):
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return ids, weights

    def forward(self, x):
        b, s, d = x.shape
        ids, weights = self.route(x)
        counts = F.one_hot(ids, self.num_experts).sum(dim=(0, 1, 2))
        recv = funcol.wait_tensor(funcol.all_to_all_single(counts.view(self.ep, self.local), None, None, self.group))
        in_splits = counts.view(self.ep, self.local).sum(-1).tolist()
        out_splits = recv.sum(-1).tolist()
        _, order = torch.sort(ids.flatten(), stable=True)
        source = order // self.top_k
        got = funcol.all_to_all_single_autograd(x.flatten(0, 1).index_select(0, source), out_splits, in_splits,
                                                self.group)
        local = torch.arange(self.local).expand(self.ep, self.local).reshape(-1).repeat_interleave(recv.flatten())
        _, perm = torch.sort(local)
        y = self.experts(got.index_select(0, perm), recv.sum(0).cumsum(0).to(torch.int32))
        back = torch.empty_like(y).scatter_(0, perm.unsqueeze(-1).expand(-1, d), y)
        ret = funcol.all_to_all_single_autograd(back, in_splits, out_splits, self.group)
        out = torch.zeros(b * s, d, dtype=torch.float32)
        out.index_add_(0, source, ret.float() * weights.flatten()[order].unsqueeze(-1))
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class HistcItemCustomOpWeightsBefore(EPBlock):
    """int32 counts from histc(ids[T,K].float(), max=E-1); in-place counts a2a into zeros_like; .item() per rank slice; weights BEFORE the experts; perm = inverse (scatter_) of repeat_interleave+cumsum destinations; buf[perm] = y; custom scatter_add_rows op; sigmoid."""

    weights_before = True

    def route(self, x):
        scores = torch.sigmoid(F.linear(x.view(-1, self.dim).float(), self.gate.weight.float()))
        weights, ids = torch.topk(scores, self.top_k)
        return ids, weights

    def forward(self, x):
        shape = x.shape
        h = x.view(-1, self.dim)
        ids, w = self.route(x)
        counts = torch.histc(ids.flatten().float(), bins=self.num_experts, min=0, max=self.num_experts - 1).int()
        recv_counts = torch.zeros_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        in_splits = [int(c.item()) for c in counts.view(self.ep, self.local).sum(1)]
        out_splits = [recv_counts[r * self.local:(r + 1) * self.local].sum().item() for r in range(self.ep)]
        order = torch.argsort(ids.flatten(), stable=True)
        token = order // self.top_k
        send = (h[token].float() * w.flatten()[order].unsqueeze(1)).to(h.dtype)
        recv = funcol.all_to_all_single_autograd(send, out_splits, in_splits, self.group)
        # destination of each received (rank-major) row in expert-major order, then its inverse
        c = recv_counts.long()
        rows = recv.shape[0]
        seg_of_row = torch.arange(self.num_experts).repeat_interleave(c, output_size=rows)
        in_start = torch.cumsum(c, 0) - c
        expert_major_lens = c.view(self.ep, self.local).t().reshape(-1)
        em_start = (torch.cumsum(expert_major_lens, 0) - expert_major_lens).view(self.local, self.ep).t().reshape(-1)
        dest = em_start[seg_of_row] + torch.arange(rows) - in_start[seg_of_row]
        perm = torch.empty_like(dest).scatter_(0, dest, torch.arange(rows))
        offs = expert_major_lens.view(self.local, self.ep).sum(1).cumsum(0).int()
        y = self.experts(recv[perm], offs)
        back = torch.empty_like(y)
        back[perm] = y
        ret = funcol.all_to_all_single_autograd(back, in_splits, out_splits, self.group)
        out = scatter_add_rows(torch.zeros(h.shape, dtype=torch.float32), token.unsqueeze(1).expand(-1, self.dim),
                               ret.float())
        return self.with_shared(out.to(x.dtype).view(shape), x)


class MegatronMaskedSelectSortChunks(EPBlock):
    """Megatron permute: bool routing_map [T,E] (from ids[T,K]) .sum(0) counts, masked_select rows/probs; counts AND tokens through the autograd.Function; host splits via .to('cpu').tolist() + host sums; split/cat chunk sort (rank-major <-> expert-major); scatter_add_ with expanded index."""

    def __init__(self, group, full, top_k):
        super().__init__(group, full, top_k)
        # Megatron keeps these chunk orders fixed per layer (here as host lists)
        chunk = torch.arange(self.num_experts)
        self.sort_input_by_local_experts = chunk.reshape(self.ep, self.local).T.ravel().tolist()
        self.restore_output_by_local_experts = chunk.reshape(self.local, self.ep).T.ravel().tolist()

    def route(self, x):
        logits = self.gate(x.view(-1, self.dim)).float()
        probs, top_indices = torch.topk(torch.softmax(logits, dim=-1), k=self.top_k, dim=1)
        return top_indices, probs / probs.sum(dim=-1, keepdim=True)

    def forward(self, x):
        hidden_states = x.view(-1, self.dim)
        num_tokens = hidden_states.shape[0]
        top_indices, probs = self.route(x)
        routing_map = torch.zeros(num_tokens, self.num_experts, dtype=torch.int32).scatter(1, top_indices, 1).bool()
        probs_map = torch.zeros(num_tokens, self.num_experts, dtype=torch.float32).scatter(1, top_indices, probs)
        num_local_tokens_per_expert = routing_map.sum(dim=0)
        num_global_tokens_per_expert = MegatronAllToAll.apply(self.group, num_local_tokens_per_expert, None, None)
        input_splits = num_local_tokens_per_expert.reshape(self.ep, self.local).sum(axis=1).to("cpu").tolist()
        per_local_expert = num_global_tokens_per_expert.reshape(self.ep, self.local).to(torch.device("cpu"))
        chunk_sizes = per_local_expert.ravel().tolist()
        output_splits = [sum(chunk_sizes[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
        # permute(tokens, routing_map): rows grouped by expert, token order inside an expert
        mask = routing_map.T.contiguous()
        token_indices = torch.arange(num_tokens).unsqueeze(0).expand(self.num_experts, -1)
        sorted_indices = token_indices.masked_select(mask)
        permuted_probs = probs_map.T.contiguous().masked_select(mask)
        permuted_input = hidden_states.index_select(0, sorted_indices)
        global_input = MegatronAllToAll.apply(self.group, permuted_input, output_splits, input_splits)
        chunks = torch.split(global_input, chunk_sizes, dim=0)
        global_input = torch.cat([chunks[i] for i in self.sort_input_by_local_experts], dim=0)
        tokens_per_expert = num_global_tokens_per_expert.reshape(self.ep, self.local).sum(dim=0)
        y = self.experts(global_input, tokens_per_expert.cumsum(0).to(torch.int32))
        chunks = torch.split(y, [chunk_sizes[i] for i in self.sort_input_by_local_experts], dim=0)
        y = torch.cat([chunks[i] for i in self.restore_output_by_local_experts], dim=0)
        permuted_output = MegatronAllToAll.apply(self.group, y, input_splits, output_splits)
        output = torch.zeros(num_tokens, self.dim, dtype=torch.float32)
        output.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, self.dim),
                            permuted_output.float() * permuted_probs.unsqueeze(-1))
        return self.with_shared(output.to(x.dtype).view_as(x), x)


class TorchAOPaddedPermute(EPBlock):
    """torchtitan + torchao permute_and_pad: groups padded to a multiple of 8 on the RECEIVER (padded counts fed to the experts), index -1 reads an appended zero row, static max_len; one_hot counts; funcol + explicit wait; index_add_; sigmoid."""

    fused_experts = True
    alignment = 8

    def route(self, x):
        scores = torch.sigmoid(self.gate(x.view(-1, self.dim)).float())
        weights, ids = torch.topk(scores, self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def _permute_and_pad(self, counts_group, max_len):
        """Indices into the received rows (plus a zero row at -1), expert-major, each group padded."""
        t_mat = counts_group.view(self.ep, self.local)
        tokens_per_expert = t_mat.sum(0)
        m_sizes = torch.clamp_min((tokens_per_expert + self.alignment - 1) // self.alignment * self.alignment,
                                  self.alignment)
        lens = t_mat.t().reshape(-1)
        starts = (counts_group.cumsum(0) - counts_group).view(self.ep, self.local).t().reshape(-1)
        padded_starts = (m_sizes.cumsum(0) - m_sizes).repeat_interleave(self.ep)
        within_expert = (lens.view(self.local, self.ep).cumsum(1) - lens.view(self.local, self.ep)).reshape(-1)
        seg = torch.arange(lens.shape[0]).repeat_interleave(lens)
        first_of_seg = lens.cumsum(0) - lens
        pos_in_seg = torch.arange(seg.shape[0]) - first_of_seg[seg]
        permuted_indices = torch.full((max_len,), -1, dtype=torch.int64)
        permuted_indices[padded_starts[seg] + within_expert[seg] + pos_in_seg] = starts[seg] + pos_in_seg
        return permuted_indices, m_sizes

    def forward(self, x):
        bs, slen, dim = x.shape
        ids, scores = self.route(x)
        num_tokens_per_expert = F.one_hot(ids.view(-1), self.num_experts).sum(0)
        counts_group = funcol.all_to_all_single(num_tokens_per_expert, None, None, self.group)
        counts_group = funcol.wait_tensor(counts_group)
        input_splits = num_tokens_per_expert.view(self.ep, -1).sum(dim=1).tolist()
        output_splits = counts_group.view(self.ep, -1).sum(dim=1).tolist()
        order = torch.argsort(ids.view(-1), stable=True)
        token = order // self.top_k
        routed_input = funcol.all_to_all_single_autograd(x.view(-1, dim)[token], output_splits, input_splits,
                                                         self.group)
        # static upper bound (every rank sends all its slots here) + room for one padded group per expert
        max_len = self.ep * bs * slen * self.top_k + self.local * self.alignment
        permuted_indices, m_sizes = self._permute_and_pad(counts_group, max_len)
        routed_input = torch.vstack((routed_input, routed_input.new_zeros((dim,))))
        input_shape = routed_input.shape
        routed_output = self.experts(routed_input[permuted_indices, :], m_sizes.cumsum(0).to(torch.int32))
        out_unpermuted = routed_output.new_empty(input_shape)
        out_unpermuted[permuted_indices, :] = routed_output
        out_unpermuted = out_unpermuted[:-1]
        returned = funcol.all_to_all_single_autograd(out_unpermuted, input_splits, output_splits, self.group)
        out = torch.zeros(bs * slen, dim, dtype=torch.float32)
        out.index_add_(0, token, returned.float() * scores.view(-1)[order].unsqueeze(-1))
        return self.with_shared(out.to(x.dtype).view(bs, slen, dim), x)


# ---------------------------------------------------------------- non-plain blocks (a DeepEP rewrite must refuse)


class CapacityDroppingDispatch(EPBlock):
    """NOT DeepEP: capacity-limited dispatch (GShard/Switch): a rank sends at most `capacity` slots per expert and drops the rest, so the rows sent are not every (token, expert) slot and the counts sent are clamped."""

    capacity = 3

    def route(self, x):
        probs = F.linear(x.flatten(0, 1).float(), self.gate.weight.float()).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = F.one_hot(flat, self.num_experts).sum(0)
        position_in_expert = torch.arange(flat.shape[0]) - (counts.cumsum(0) - counts)[flat[order]]
        kept = order[position_in_expert < self.capacity]
        sent_counts = counts.clamp(max=self.capacity)
        received_counts = funcol.wait_tensor(funcol.all_to_all_single(sent_counts, None, None, self.group))
        input_splits = sent_counts.view(self.ep, -1).sum(1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(1).tolist()
        received = funcol.all_to_all_single_autograd(x.view(-1, d)[kept // self.top_k], output_splits, input_splits,
                                                     self.group)
        local_id = torch.arange(self.local).repeat(self.ep).repeat_interleave(received_counts,
                                                                              output_size=received.shape[0])
        perm = torch.argsort(local_id, stable=True)
        y = self.experts(received[perm], received_counts.view(self.ep, -1).sum(0).cumsum(0).to(torch.int32))
        returned = funcol.all_to_all_single_autograd(torch.zeros_like(y).index_copy(0, perm, y), input_splits,
                                                     output_splits, self.group)
        rows = returned.float() * weights.reshape(-1)[kept].unsqueeze(-1)
        out = torch.zeros(b * s, d, dtype=torch.float32).index_add_(0, kept // self.top_k, rows)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class SenderPaddedGroups(EPBlock):
    """NOT DeepEP: the SENDER pads each expert's group to a multiple of 4 with zero rows, so the counts exchanged are padded and the rows sent include padding (DeepEP sends exactly one row per slot)."""

    multiple = 4

    def route(self, x):
        probs = torch.softmax(self.gate(x.view(-1, self.dim)).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        h = x.view(-1, d)
        ids, weights = self.route(x)
        flat = ids.view(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + self.multiple - 1) // self.multiple * self.multiple
        sorted_expert = flat[order]
        dest = (padded.cumsum(0) - padded)[sorted_expert] + torch.arange(flat.shape[0]) \
            - (counts.cumsum(0) - counts)[sorted_expert]
        send = h.new_zeros(int(padded.sum().item()), d).index_copy(0, dest, h[order // self.top_k])
        received_counts = funcol.wait_tensor(funcol.all_to_all_single(padded, None, None, self.group))
        input_splits = padded.view(self.ep, -1).sum(1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(1).tolist()
        received = funcol.all_to_all_single_autograd(send, output_splits, input_splits, self.group)
        local_id = torch.arange(self.local).repeat(self.ep).repeat_interleave(received_counts,
                                                                              output_size=received.shape[0])
        perm = torch.argsort(local_id, stable=True)
        y = self.experts(received[perm], received_counts.view(self.ep, -1).sum(0).cumsum(0).to(torch.int32))
        returned = funcol.all_to_all_single_autograd(torch.zeros_like(y).index_copy(0, perm, y), input_splits,
                                                     output_splits, self.group)
        rows = returned[dest].float() * weights.view(-1)[order].unsqueeze(-1)
        out = torch.zeros(b * s, d, dtype=torch.float32).index_add_(0, order // self.top_k, rows)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class ScatterReduceMeanCombine(EPBlock):
    """NOT DeepEP: the combine averages a token's K weighted rows (scatter_reduce 'mean') instead of summing them."""

    combine = "mean"

    def route(self, x):
        probs = F.linear(x.flatten(0, 1).float(), self.gate.weight.float()).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = F.one_hot(flat, self.num_experts).sum(0)
        received_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group))
        input_splits = counts.view(self.ep, -1).sum(1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(1).tolist()
        received = funcol.all_to_all_single_autograd(x.view(-1, d)[token], output_splits, input_splits, self.group)
        local_id = torch.arange(self.local).repeat(self.ep).repeat_interleave(received_counts,
                                                                              output_size=received.shape[0])
        perm = torch.argsort(local_id, stable=True)
        y = self.experts(received[perm], received_counts.view(self.ep, -1).sum(0).cumsum(0).to(torch.int32))
        returned = funcol.all_to_all_single_autograd(torch.zeros_like(y).index_copy(0, perm, y), input_splits,
                                                     output_splits, self.group)
        rows = returned.float() * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(b * s, d, dtype=torch.float32).scatter_reduce(
            0, token.unsqueeze(-1).expand(-1, d), rows, reduce="mean", include_self=False)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


CATALOG: dict[str, tuple[type[EPBlock], bool]] = {
    cls.__name__: (cls, plain) for cls, plain in (
        (OneHotTolistIndexAdd, True),
        (TorchtitanLike2DCounts, True),
        (BincountItemIndexPut, True),
        (MegatronAutogradFunction, True),
        (DeepSeekWeightsBefore, True),
        (SlotOrderReshapeSum, True),
        (Compact2DOneHotSortIndexSelect, True),
        (HistcItemCustomOpWeightsBefore, True),
        (MegatronMaskedSelectSortChunks, True),
        # padded groups: DeepEP dispatch has no padding, and moepass's grouped ops pad internally; this
        # spelling is left alone with a reason (a documented limitation), not rewritten
        (TorchAOPaddedPermute, False),
        (CapacityDroppingDispatch, False),
        (SenderPaddedGroups, False),
        (ScatterReduceMeanCombine, False),
    )
}


def build(name: str, group: dist.ProcessGroup, dim: int = 64, experts: int = 8, top_k: int = 2,
          seed: int = 0) -> EPBlock:
    """The block `name` holding this rank's experts of one full init (identical on every rank)."""
    cls, _ = CATALOG[name]
    return cls(group, full_weights(dim, experts, seed), top_k)


# ---------------------------------------------------------------- the non-EP reference


def _kept_slots(ids: torch.Tensor, num_experts: int, capacity: int | None) -> torch.Tensor:
    """[T, K] bool: slot kept when fewer than `capacity` earlier slots (token-major) chose its expert."""
    if capacity is None:
        return torch.ones_like(ids, dtype=torch.bool)
    seen = [0] * num_experts
    kept = torch.zeros_like(ids, dtype=torch.bool)
    for t, k in ((t, k) for t in range(ids.shape[0]) for k in range(ids.shape[1])):
        e = int(ids[t, k])
        kept[t, k] = seen[e] < capacity
        seen[e] += 1
    return kept


def reference(block: EPBlock, x: torch.Tensor) -> torch.Tensor:
    """`block` on x [B, S, D] without expert parallelism: all E experts local, a loop over experts."""
    full = block.full_weights
    b, s, d = x.shape
    ids, weights = block.route(x)
    ids, weights = ids.reshape(b * s, -1), weights.reshape(b * s, -1).float()
    kept = _kept_slots(ids, block.num_experts, block.capacity)
    tokens = x.reshape(b * s, d)
    out = torch.zeros(b * s, d, dtype=torch.float32)
    for e in range(block.num_experts):
        token, k = torch.nonzero((ids == e) & kept, as_tuple=True)
        rows = tokens[token]
        w = weights[token, k].unsqueeze(-1)
        if block.weights_before:
            rows = (rows.float() * w).to(x.dtype)
        y = F.linear(F.silu(F.linear(rows, full["w1"][e])) * F.linear(rows, full["w3"][e]), full["w2"][e]).float()
        out.index_add_(0, token, y if block.weights_before else y * w)
    if block.combine == "mean":
        out = out / kept.sum(-1, keepdim=True).clamp(min=1)
    out = out.to(x.dtype).view(b, s, d)
    if block.has_shared:
        shared = F.linear(F.silu(F.linear(x, full["s1"])) * F.linear(x, full["s3"]), full["s2"])
        out = out + shared
    return out
