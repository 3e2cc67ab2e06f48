"""Expert-parallel MoE blocks whose per-expert token counts have a length the FX graph only bounds.

`torch.bincount(ids, minlength=E)` returns max(E, max(ids) + 1) counts: under Dynamo (with
capture_dynamic_output_shape_ops) its length is an unbacked symbol u0 of which only `u0 >= E` is known, and every
view, sum and all-to-all of the counts carries it (the counts all-to-all sends int64[u0]). The routing
never yields an id >= E, so at run time u0 == E. A spelling that needs the length to equal E (repeat_interleave
over an arange(E), reshape(ep, E/ep)) either fails to trace ("Could not guard on data-dependent expression") or
makes Dynamo assert u0 == E, after which the graph's length is E again ("pinned"). Same API and conventions as
tests/independent/ep_catalog.py (its EPBlock, MegatronAllToAll, full_weights and `reference` are reused):
x [B, S, D] bf16, top-k of E experts, rank r owns experts [r*E/ep, (r+1)*E/ep), SwiGLU experts, three
all-to-alls (counts, tokens, tokens back). Every block is a numerically correct EP implementation of what it
says (on every rank its output == `reference(block, x)`), traces with fullgraph=True given capture_scalar_outputs
and capture_dynamic_output_shape_ops, and is written after a public codebase:

  BincountTolistIndexAdd         the plain spelling: bincount(ids.view(-1), minlength=E), funcol counts a2a,
                                 .tolist() splits, all_to_all_single_autograd, receiver argsort over local ids
                                 rebuilt by repeat_interleave, _grouped_mm SwiGLU, index_add_ with the weights
  TorchtitanDispatcherBincount   torchtitan's AllToAllTokenDispatcher (a dispatcher object with dispatch/combine
                                 and frozen metadata; [ep, E/ep] counts exchange, segment-arithmetic _permute)
                                 fed bincount counts by its MoE module
  MegatronDispatcherBincount     Megatron-LM MoEAlltoAllTokenDispatcher (preprocess / token_permutation /
                                 token_unpermutation; in-place c10d counts a2a; autograd.Function token a2a;
                                 sort_chunks_by_idxs split/cat to expert-major); its reshape(ep, E/ep) pins u0 == E
  Llama4ScoresBeforeBincount     Llama 4 (HF Llama4TextMoe / torchtitan score_before_experts): sigmoid scores of a
                                 top-k over E logits scale the rows BEFORE the experts; plain bf16 scatter_add_
  DeepSeekV3GroupLimitedBincount DeepSeek-V3 inference Gate (group-limited routing: top-k over groups' scores,
                                 masked, then top-k over experts, bias for selection only, route_scale) and its
                                 MoE's bincount(indices.flatten(), minlength=E), here over all-to-alls
  FlatBSKViewBincount            router on [B, S, D] giving ids [B, S, K]; bincount on the flat [T*K] view;
                                 counts a2a with explicit equal splits; slots restored and summed over K as
                                 view(B, S, K, D) * w
  ReceiverBincountOffsets        the receiver recounts its groups: bincount(rebuilt local ids, minlength=E/ep)
                                 gives the grouped GEMM offsets (that length is pinned to E/ep by _grouped_mm)

one deliberate negative, bounded counts but not a DeepEP region (a pass taught to take bounded counts must still
refuse it):

  BincountCapacityDropping       Switch / GShard expert capacity: counts bincount(...).clamp(max=capacity), slots
                                 over the capacity dropped on the sender

and two static-length controls, the plain block with its count spelled so the length is exactly E (a rewrite
the bounded blocks miss but these get is about the bound, not the spelling):

  ScatterAddCountsControl        counts = zeros(E).scatter_add_(0, ids, ones)
  HistcCountsControl             counts = histc(ids.float(), bins=E, min=0, max=E-1)

COUNTS_LENGTH says, per block, what the traced graph knows of the counts' length ("bounded", "pinned",
"static"); DEEPEP_REGION says whether the block is a DeepEP dispatch/combine region by what it computes (every
slot sent once, un-padded, and summed back per token) and why.

API: CATALOG (name -> (cls, plain)), DEEPEP_REGION, COUNTS_LENGTH, build(name, group, dim, experts, top_k, seed);
reference is ep_catalog.reference. Import with this folder on sys.path. Probe: probe_ep_catalog_bounded.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ep_catalog import EPBlock, MegatronAllToAll, full_weights, reference  # noqa: F401  (reference: re-exported)


def _softmax_topk_renorm(block: EPBlock, x: torch.Tensor):
    probs = torch.softmax(F.linear(x.reshape(-1, block.dim), block.gate.weight).float(), dim=-1)
    weights, ids = torch.topk(probs, block.top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


# ---------------------------------------------------------------- 1. the plain spelling


class BincountTolistIndexAdd(EPBlock):
    """bincount(topk_ids.view(-1), minlength=E); funcol.all_to_all_single counts; view(ep, -1).sum(1).tolist() splits; all_to_all_single_autograd tokens; receiver argsort(stable) over (arange(len(received counts)) % E_l).repeat_interleave(received counts); _grouped_mm SwiGLU; index_copy un-permute; reverse a2a; index_add_ with the routing weights."""

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def tokens_per_expert(self, flat_ids):
        return torch.bincount(flat_ids, minlength=self.num_experts)

    def forward(self, x):
        b, s, d = x.shape
        topk_ids, topk_weights = self.route(x)
        flat_ids = topk_ids.view(-1)
        counts = self.tokens_per_expert(flat_ids)
        received_counts = funcol.all_to_all_single(counts, None, None, self.group)
        input_splits = counts.view(self.ep, -1).sum(dim=1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(dim=1).tolist()
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // self.top_k
        received = funcol.all_to_all_single_autograd(x.view(-1, d)[token_of_row], output_splits, input_splits,
                                                     self.group)
        # as long as the counts: arange(E_l).repeat(ep) does not trace (Dynamo cannot prove len(counts) == E)
        local_expert_of_row = (torch.arange(received_counts.shape[0]) % self.local).repeat_interleave(
            received_counts, output_size=received.shape[0])
        perm = torch.argsort(local_expert_of_row, stable=True)
        offs = received_counts.view(self.ep, -1).sum(dim=0).cumsum(dim=0).to(torch.int32)
        y = self.experts(received[perm], offs)
        back = torch.zeros_like(y).index_copy(0, perm, y)
        returned = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        rows = returned.float() * topk_weights.view(-1)[order].unsqueeze(-1)
        out = torch.zeros(b * s, d, dtype=torch.float32).index_add_(0, token_of_row, rows)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


class ScatterAddCountsControl(BincountTolistIndexAdd):
    """Control: BincountTolistIndexAdd with counts = zeros(E).scatter_add_(0, ids, ones) (length exactly E)."""

    def tokens_per_expert(self, flat_ids):
        return torch.zeros(self.num_experts, dtype=torch.int64).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))


class HistcCountsControl(BincountTolistIndexAdd):
    """Control: BincountTolistIndexAdd with counts = histc(ids.float(), bins=E, min=0, max=E-1) (length exactly E)."""

    def tokens_per_expert(self, flat_ids):
        return torch.histc(flat_ids.float(), bins=self.num_experts, min=0, max=self.num_experts - 1).long()


# ---------------------------------------------------------------- 2. torchtitan's token dispatcher object


@dataclass(frozen=True, kw_only=True)
class AllToAllDispatchMetadata:
    """What combine() needs from dispatch() (torchtitan's AllToAllDispatchMetadata)."""

    token_indices_experts_sorted_N: torch.Tensor  # noqa: N815
    topk_scores_experts_sorted_N: torch.Tensor  # noqa: N815
    input_shape: tuple
    permuted_indices: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]


class AllToAllTokenDispatcher:
    """torchtitan models/common/token_dispatcher.py AllToAllTokenDispatcher, funcol path. Not an nn.Module."""

    def __init__(self, num_experts: int, top_k: int, group: dist.ProcessGroup):
        self.num_experts, self.top_k, self.group = num_experts, top_k, group
        self.ep_size = dist.get_world_size(group)

    def _local_reorder(self, x_TD, topk_scores_TK, topk_expert_ids_TK):
        token_indices_experts_sorted_N = torch.argsort(topk_expert_ids_TK.view(-1), stable=True)
        topk_scores_experts_sorted_N = topk_scores_TK.view(-1)[token_indices_experts_sorted_N]
        token_indices_experts_sorted_N = token_indices_experts_sorted_N // self.top_k
        return x_TD[token_indices_experts_sorted_N], token_indices_experts_sorted_N, topk_scores_experts_sorted_N

    def _permute(self, routed_input_RD, num_global_tokens_per_local_expert_E):
        """Rank-major (e0,r0), (e1,r0), ... -> expert-major (e0,r0), (e0,r1), ..."""
        e = num_global_tokens_per_local_expert_E.shape[0] // self.ep_size
        total = routed_input_RD.shape[0]
        t_mat = num_global_tokens_per_local_expert_E.view(self.ep_size, e)
        input_starts = (num_global_tokens_per_local_expert_E.cumsum(0)
                        - num_global_tokens_per_local_expert_E).view(self.ep_size, e)
        segment_lens = t_mat.t().reshape(-1)
        input_starts = input_starts.t().reshape(-1)
        seg_ids = torch.arange(segment_lens.shape[0]).repeat_interleave(segment_lens, output_size=total)
        output_starts = segment_lens.cumsum(0) - segment_lens
        permuted_indices = input_starts[seg_ids] + torch.arange(seg_ids.shape[0]) - output_starts[seg_ids]
        return routed_input_RD.shape, routed_input_RD[permuted_indices, :], permuted_indices, t_mat.sum(0)

    def dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        routed_input_ND, token_indices_experts_sorted_N, topk_scores_experts_sorted_N = self._local_reorder(
            x_TD, topk_scores_TK, topk_expert_ids_TK)
        with torch.no_grad():
            num_global_tokens_per_local_expert_EP_e = funcol.all_to_all_single(
                num_local_tokens_per_expert_E.view(self.ep_size, -1), None, None, group=self.group)
            num_global_tokens_per_local_expert_EP_e = torch.ops._c10d_functional.wait_tensor(
                num_global_tokens_per_local_expert_EP_e)
            num_global_tokens_per_local_expert_E = num_global_tokens_per_local_expert_EP_e.reshape(-1)
            input_splits = num_local_tokens_per_expert_E.view(self.ep_size, -1).sum(dim=1).to(
                torch.device("cpu"), non_blocking=True)
            # NOTE: this would incur a device-to-host sync
            output_splits = num_global_tokens_per_local_expert_E.view(self.ep_size, -1).sum(dim=1).to(
                torch.device("cpu"), non_blocking=False)
            input_splits_list, output_splits_list = input_splits.tolist(), output_splits.tolist()
        routed_input_RD = funcol.all_to_all_single_autograd(routed_input_ND, output_splits_list, input_splits_list,
                                                            self.group)
        input_shape, routed_input_RD, permuted_indices, num_global_tokens_per_local_expert_e = self._permute(
            routed_input_RD, num_global_tokens_per_local_expert_E)
        metadata = AllToAllDispatchMetadata(
            token_indices_experts_sorted_N=token_indices_experts_sorted_N,
            topk_scores_experts_sorted_N=topk_scores_experts_sorted_N, input_shape=input_shape,
            permuted_indices=permuted_indices, input_splits=input_splits_list, output_splits=output_splits_list)
        return routed_input_RD, num_global_tokens_per_local_expert_e, metadata

    def combine(self, routed_output_RD, metadata: AllToAllDispatchMetadata, x_TD):
        out_unpermuted_RD = routed_output_RD.new_empty(metadata.input_shape)
        out_unpermuted_RD[metadata.permuted_indices, :] = routed_output_RD
        routed_output_ND = funcol.all_to_all_single_autograd(out_unpermuted_RD, metadata.input_splits,
                                                             metadata.output_splits, self.group)
        routed_output_ND = (routed_output_ND.to(torch.float32)
                            * metadata.topk_scores_experts_sorted_N.reshape(-1, 1)).to(routed_output_ND.dtype)
        dim = x_TD.shape[-1]
        index = metadata.token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, dim)
        return torch.zeros(x_TD.shape, dtype=torch.float32).scatter_add(0, index, routed_output_ND.float())


class TorchtitanDispatcherBincount(EPBlock):
    """torchtitan MoE with an AllToAllTokenDispatcher object: sigmoid router on [T, D]; num_local_tokens_per_expert_E = bincount(ids.view(-1), minlength=E); [ep, E/ep] counts a2a in no_grad + wait_tensor + reshape(-1); .to(cpu) splits; segment-arithmetic _permute; new_empty + index_put _unpermute; scores after (fp32 product cast back); scatter_add."""

    def __init__(self, group, full, top_k):
        super().__init__(group, full, top_k)
        self.token_dispatcher = AllToAllTokenDispatcher(self.num_experts, top_k, group)

    def route(self, x):
        scores = torch.sigmoid(self.gate(x.reshape(-1, self.dim)).to(torch.float32))
        top_scores, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=-1)
        return selected_experts_indices, top_scores / top_scores.sum(dim=-1, keepdim=True)

    def forward(self, x):
        bs, slen, dim = x.shape
        x_TD = x.view(-1, dim)
        topk_expert_ids_TK, topk_scores_TK = self.route(x)
        num_local_tokens_per_expert_E = torch.bincount(topk_expert_ids_TK.view(-1), minlength=self.num_experts)
        routed_input_RD, num_tokens_per_local_expert_e, metadata = self.token_dispatcher.dispatch(
            x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)
        offsets_e = torch.cumsum(num_tokens_per_local_expert_e, dim=0, dtype=torch.int32)
        routed_output_RD = self.experts(routed_input_RD, offsets_e)
        out_TD = self.token_dispatcher.combine(routed_output_RD, metadata, x_TD)
        return self.with_shared(out_TD.to(x.dtype).view(bs, slen, dim), x)


# ---------------------------------------------------------------- 3. Megatron-LM's all-to-all token dispatcher


def sort_chunks_by_idxs(tokens: torch.Tensor, split_sizes: list[int], sorted_idxs: list[int]) -> torch.Tensor:
    """Megatron moe_utils.sort_chunks_by_idxs: split by host sizes, concatenate in a fixed chunk order."""
    chunks = torch.split(tokens, split_sizes, dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


class MoEAlltoAllTokenDispatcher:
    """Megatron-LM core/transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher (tp = 1, no drop)."""

    def __init__(self, num_experts: int, top_k: int, group: dist.ProcessGroup):
        self.num_experts, self.router_topk, self.ep_group = num_experts, top_k, group
        self.ep_size = dist.get_world_size(group)
        self.num_local_experts = num_experts // self.ep_size
        chunk = torch.arange(num_experts)
        self.sort_input_by_local_experts = chunk.reshape(-1, self.num_local_experts).T.ravel().tolist()
        self.restore_output_by_local_experts = chunk.reshape(self.num_local_experts, -1).T.ravel().tolist()

    def preprocess(self, indices: torch.Tensor) -> torch.Tensor:
        num_local_tokens_per_expert = torch.bincount(indices.view(-1), minlength=self.num_experts)
        self.input_splits = num_local_tokens_per_expert.reshape(self.ep_size, self.num_local_experts).sum(
            axis=1).to(torch.device("cpu"), non_blocking=True).tolist()
        num_global_tokens_per_expert = torch.empty_like(num_local_tokens_per_expert)
        dist.all_to_all_single(num_global_tokens_per_expert, num_local_tokens_per_expert, group=self.ep_group)
        num_global_tokens_per_expert = num_global_tokens_per_expert.reshape(self.ep_size, self.num_local_experts)
        self.output_splits = num_global_tokens_per_expert.sum(axis=-1).to(torch.device("cpu")).tolist()
        num_tokens_per_local_expert = num_global_tokens_per_expert.sum(axis=0)
        self.num_global_tokens_per_local_expert_cpu = num_global_tokens_per_expert.view(
            -1, self.num_local_experts).to(torch.device("cpu"))
        return num_tokens_per_local_expert

    def token_permutation(self, hidden_states, probs, indices):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        tokens_per_expert = self.preprocess(indices)
        self.reversed_local_input_permutation_mapping = torch.argsort(indices.view(-1), stable=True)
        self.probs = probs.view(-1)[self.reversed_local_input_permutation_mapping]
        permutated_local_input_tokens = hidden_states.index_select(
            0, self.reversed_local_input_permutation_mapping // self.router_topk)
        global_input_tokens = MegatronAllToAll.apply(self.ep_group, permutated_local_input_tokens,
                                                     self.output_splits, self.input_splits)
        self.chunk_sizes = self.num_global_tokens_per_local_expert_cpu.ravel().tolist()
        global_input_tokens = sort_chunks_by_idxs(global_input_tokens, self.chunk_sizes,
                                                  self.sort_input_by_local_experts)
        return global_input_tokens, tokens_per_expert

    def token_unpermutation(self, hidden_states):
        hidden_states = sort_chunks_by_idxs(hidden_states, [self.chunk_sizes[i] for i in
                                                            self.sort_input_by_local_experts],
                                            self.restore_output_by_local_experts)
        permutated_local_input_tokens = MegatronAllToAll.apply(self.ep_group, hidden_states, self.input_splits,
                                                               self.output_splits)
        index = (self.reversed_local_input_permutation_mapping // self.router_topk).unsqueeze(1).expand(
            -1, self.hidden_shape[-1])
        output = torch.zeros(self.hidden_shape[0] * self.hidden_shape[1], self.hidden_shape[-1],
                             dtype=torch.float32)
        output.scatter_add_(0, index, permutated_local_input_tokens.float() * self.probs.unsqueeze(1))
        return output.view(self.hidden_shape)


class MegatronDispatcherBincount(EPBlock):
    """Megatron MoELayer: topk-then-softmax router; MoEAlltoAllTokenDispatcher with bincount(indices.view(-1), minlength=E) counts; input splits to the host BEFORE the in-place c10d counts a2a; MegatronAllToAll autograd.Function; sort_chunks_by_idxs split/cat; scatter_add_ with expanded index."""

    fused_experts = True

    def __init__(self, group, full, top_k):
        super().__init__(group, full, top_k)
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(self.num_experts, top_k, group)

    def route(self, x):
        logits = self.gate(x.view(-1, self.dim)).float()
        scores, top_indices = torch.topk(logits, k=self.top_k, dim=1)
        return top_indices, torch.softmax(scores, dim=-1, dtype=torch.float32)

    def forward(self, x):
        indices, probs = self.route(x)
        dispatched_input, tokens_per_expert = self.token_dispatcher.token_permutation(x, probs, indices)
        expert_output = self.experts(dispatched_input, tokens_per_expert.cumsum(0).to(torch.int32))
        output = self.token_dispatcher.token_unpermutation(expert_output)
        return self.with_shared(output.to(x.dtype), x)


# ---------------------------------------------------------------- 4. Llama 4: scores before the experts


class Llama4ScoresBeforeBincount(EPBlock):
    """Llama 4 (HF Llama4TextMoe, torchtitan score_before_experts=True): top-k over E logits, sigmoid of the top values; rows scaled by their score on the SENDER; bincount(router_indices.flatten(), minlength=E); funcol counts a2a + wait; [int(c) for c in ...] splits; receiver (rank, expert) segment of each row by bucketize(arange(R), cumsum(counts), right=True) % E_l + argsort; fused gate_up experts; scatter_ un-permute; plain bf16 scatter_add_ combine."""

    fused_experts = True
    weights_before = True

    def route(self, x):
        router_logits = F.linear(x.reshape(-1, self.dim), self.gate.weight)
        router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=1)
        return router_indices, torch.sigmoid(router_top_value.float())

    def forward(self, x):
        b, s, hidden_dim = x.shape
        hidden_states = x.reshape(-1, hidden_dim)
        router_indices, router_scores = self.route(x)
        flat = router_indices.flatten()
        tokens_per_expert = torch.bincount(flat, minlength=self.num_experts)
        tokens_per_expert_group = funcol.wait_tensor(
            funcol.all_to_all_single(tokens_per_expert, None, None, self.group))
        input_splits = [int(c) for c in tokens_per_expert.view(self.ep, -1).sum(dim=1)]
        output_splits = [int(c) for c in tokens_per_expert_group.view(self.ep, -1).sum(dim=1)]
        sorted_slots = flat.argsort(stable=True)
        token_idx = sorted_slots // self.top_k
        routed_in = (hidden_states[token_idx].float() * router_scores.flatten()[sorted_slots, None]).to(x.dtype)
        gathered = funcol.all_to_all_single_autograd(routed_in, output_splits, input_splits, self.group)
        # row r belongs to the (rank, expert) segment whose inclusive cumsum first exceeds r
        segment_of_row = torch.bucketize(torch.arange(gathered.shape[0]), tokens_per_expert_group.cumsum(0),
                                         right=True)
        expert_of_row = segment_of_row % self.local
        by_expert = expert_of_row.argsort(stable=True)
        offs = tokens_per_expert_group.view(self.ep, -1).sum(dim=0).cumsum(dim=0).to(torch.int32)
        routed_out = self.experts(gathered[by_expert], offs)
        unsorted = torch.empty_like(routed_out).scatter_(
            0, by_expert.unsqueeze(-1).expand(-1, hidden_dim), routed_out)
        returned = funcol.all_to_all_single_autograd(unsorted, input_splits, output_splits, self.group)
        out = torch.zeros_like(hidden_states)
        out.scatter_add_(dim=0, index=token_idx.unsqueeze(-1).expand(-1, hidden_dim), src=returned)
        return self.with_shared(out.view(b, s, hidden_dim), x)


# ---------------------------------------------------------------- 5. DeepSeek-V3 group-limited routing


class DeepSeekV3GroupLimitedBincount(EPBlock):
    """DeepSeek-V3 inference/model.py Gate: sigmoid scores, + bias for selection only, group score = sum of each group's top-2, top topk_groups groups, other groups masked to -inf, top-k over experts, weights = original scores gathered, renormalised, * route_scale; MoE counts bincount(indices.flatten(), minlength=E); in-place c10d counts a2a; .cpu().tolist(); receiver ids torch.repeat_interleave(counts) % E_l + sort(stable); index_put_ un-permute; index_add_ of rows * weights, type_as(x)."""

    fused_experts = True
    n_groups, topk_groups, route_scale = 4, 2, 2.5

    def __init__(self, group, full, top_k):
        super().__init__(group, full, top_k)
        # e_score_correction_bias: steers selection only (the same on every rank)
        self.register_buffer("bias", torch.linspace(-0.05, 0.05, self.num_experts), persistent=False)

    def route(self, x):
        scores = F.linear(x.reshape(-1, self.dim), self.gate.weight).float().sigmoid()
        original_scores = scores
        scores = scores + self.bias
        scores = scores.view(scores.size(0), self.n_groups, -1)
        group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(self.topk_groups, dim=-1)[1]
        mask = scores.new_ones(scores.size(0), self.n_groups, dtype=torch.bool).scatter_(1, indices, False)
        scores = scores.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        indices = torch.topk(scores, self.top_k, dim=-1)[1]
        weights = original_scores.gather(1, indices)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights * self.route_scale

    def forward(self, x):
        shape = x.size()
        x2 = x.view(-1, self.dim)
        indices, weights = self.route(x)
        counts = torch.bincount(indices.flatten(), minlength=self.num_experts)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_sizes = counts.view(self.ep, -1).sum(dim=-1).cpu().tolist()
        recv_sizes = recv_counts.view(self.ep, -1).sum(dim=-1).cpu().tolist()
        idxs = indices.flatten().argsort(stable=True)
        tokens = funcol.all_to_all_single_autograd(x2[idxs // self.top_k], recv_sizes, send_sizes, self.group)
        local_idx = torch.repeat_interleave(recv_counts, output_size=tokens.shape[0]) % self.local
        _, by_local = local_idx.sort(stable=True)
        y = self.experts(tokens[by_local], recv_counts.view(self.ep, -1).sum(dim=0).cumsum(0).int())
        y = torch.zeros_like(y).index_put_((by_local,), y)
        y = funcol.all_to_all_single_autograd(y, send_sizes, recv_sizes, self.group)
        out = torch.zeros(x2.shape, dtype=torch.float32)
        out.index_add_(0, idxs // self.top_k, y.float() * weights.flatten()[idxs, None])
        return self.with_shared(out.type_as(x).view(shape), x)


# ---------------------------------------------------------------- 6. [B, S, K] ids, bincount on the flat view


class FlatBSKViewBincount(EPBlock):
    """Router on x [B, S, D] giving ids [B, S, K] (torchtitan-style); bincount(ids.view(-1), minlength=E) over the flat [T*K] view; counts a2a with explicit equal splits [E/ep] * ep + wait (the received counts' length is static E, the sent ones' only bounded); view(ep, -1) .cpu().tolist(); torch.sort(stable) slots; expert-major receiver by argsort of (arange(E) % E_l).repeat_interleave(received counts); slots restored by slots[order] = rows; view(B, S, K, D) * w summed over K; softmax without renorm."""

    def route(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        return ids, weights

    def forward(self, x):
        b, s, d = x.shape
        ids_BSK, w_BSK = self.route(x)
        flat = ids_BSK.view(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        recv_counts = funcol.wait_tensor(funcol.all_to_all_single(counts, [self.local] * self.ep,
                                                                  [self.local] * self.ep, self.group))
        input_splits = counts.view(self.ep, -1).sum(-1).cpu().tolist()
        output_splits = recv_counts.view(self.ep, -1).sum(-1).cpu().tolist()
        _, order = torch.sort(flat, stable=True)
        recv = funcol.all_to_all_single_autograd(x.view(b * s, d)[order // self.top_k], output_splits, input_splits,
                                                 self.group)
        expert_of_row = (torch.arange(self.num_experts) % self.local).repeat_interleave(
            recv_counts, output_size=recv.shape[0])
        perm = torch.argsort(expert_of_row, stable=True)
        y = self.experts(recv[perm], recv_counts.view(self.ep, -1).sum(0).cumsum(0).to(torch.int32))
        back = torch.empty_like(y)
        back[perm] = y
        ret = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        slots = torch.empty_like(ret)
        slots[order] = ret
        out = (slots.view(b, s, self.top_k, d).float() * w_BSK.unsqueeze(-1)).sum(dim=2)
        return self.with_shared(out.to(x.dtype), x)


# ---------------------------------------------------------------- 7. the receiver recounts its groups


class ReceiverBincountOffsets(EPBlock):
    """bincount counts on the sender AND on the receiver: the grouped GEMM offsets come from bincount(rebuilt local expert ids, minlength=E/ep).cumsum (not from the counts matrix); funcol counts a2a + wait; .tolist(); local ids arange(counts.view(ep, -1).shape[1]).repeat(ep).repeat_interleave(counts); argsort(stable); index_copy_; index_add_; sigmoid router; no shared expert."""

    has_shared = False

    def route(self, x):
        scores = torch.sigmoid(F.linear(x.reshape(-1, self.dim), self.gate.weight).float())
        weights, ids = scores.topk(self.top_k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x):
        b, s, d = x.shape
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        send_counts = torch.bincount(flat, minlength=self.num_experts)
        recv_counts = funcol.wait_tensor(funcol.all_to_all_single(send_counts, None, None, self.group))
        input_splits = send_counts.view(self.ep, -1).sum(1).tolist()
        output_splits = recv_counts.view(self.ep, -1).sum(1).tolist()
        order = flat.argsort(stable=True)
        token = order // self.top_k
        recv = funcol.all_to_all_single_autograd(x.reshape(-1, d)[token], output_splits, input_splits, self.group)
        per_rank = recv_counts.view(self.ep, -1)
        local_id = torch.arange(per_rank.shape[1]).repeat(self.ep).repeat_interleave(recv_counts,
                                                                                     output_size=recv.shape[0])
        perm = local_id.argsort(stable=True)
        tokens_per_local_expert = torch.bincount(local_id, minlength=self.local)
        y = self.experts(recv[perm], tokens_per_local_expert.cumsum(0).to(torch.int32))
        back = torch.zeros_like(y)
        back.index_copy_(0, perm, y)
        ret = funcol.all_to_all_single_autograd(back, input_splits, output_splits, self.group)
        rows = ret.float() * weights.reshape(-1, 1)[order]
        out = torch.zeros(b * s, d, dtype=torch.float32).index_add_(0, token, rows)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


# ---------------------------------------------------------------- a negative: bounded counts, slots dropped


class BincountCapacityDropping(EPBlock):
    """NOT DeepEP: Switch Transformer / GShard expert capacity over bincount counts: a rank sends at most `capacity` slots per expert (the first in token-major order) and drops the rest, so the counts sent are bincount(...).clamp(max=capacity) and not every (token, expert) slot reaches an expert."""

    capacity = 3

    def route(self, x):
        return _softmax_topk_renorm(self, x)

    def forward(self, x):
        b, s, d = x.shape
        ids, weights = self.route(x)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)
        order = torch.argsort(flat, stable=True)
        position_in_expert = torch.arange(flat.shape[0]) - (counts.cumsum(0) - counts)[flat[order]]
        kept = order[position_in_expert < self.capacity]  # overflow slots dropped, as Switch does
        sent_counts = counts.clamp(max=self.capacity)
        received_counts = funcol.wait_tensor(funcol.all_to_all_single(sent_counts, None, None, self.group))
        input_splits = sent_counts.view(self.ep, -1).sum(1).tolist()
        output_splits = received_counts.view(self.ep, -1).sum(1).tolist()
        token = kept // self.top_k
        recv = funcol.all_to_all_single_autograd(x.view(-1, d)[token], output_splits, input_splits, self.group)
        local_id = (torch.arange(received_counts.shape[0]) % self.local).repeat_interleave(
            received_counts, output_size=recv.shape[0])
        perm = torch.argsort(local_id, stable=True)
        y = self.experts(recv[perm], received_counts.view(self.ep, -1).sum(0).cumsum(0).to(torch.int32))
        ret = funcol.all_to_all_single_autograd(torch.zeros_like(y).index_copy(0, perm, y), input_splits,
                                                output_splits, self.group)
        rows = ret.float() * weights.reshape(-1)[kept].unsqueeze(-1)
        out = torch.zeros(b * s, d, dtype=torch.float32).index_add_(0, token, rows)
        return self.with_shared(out.to(x.dtype).view(b, s, d), x)


CATALOG: dict[str, tuple[type[EPBlock], bool]] = {
    cls.__name__: (cls, True) for cls in (
        BincountTolistIndexAdd, TorchtitanDispatcherBincount, MegatronDispatcherBincount, Llama4ScoresBeforeBincount,
        DeepSeekV3GroupLimitedBincount, FlatBSKViewBincount, ReceiverBincountOffsets, ScatterAddCountsControl,
        HistcCountsControl)
} | {BincountCapacityDropping.__name__: (BincountCapacityDropping, False)}

# the length of the counts in the traced graph: "bounded" (bincount: an unbacked u0, only u0 >= E known),
# "pinned" (bincount, but a later reshape(ep, E/ep) makes Dynamo assert u0 == E) or "static" (exactly E)
COUNTS_LENGTH: dict[str, str] = {
    name: "static" if name.endswith("Control") else "pinned" if name == "MegatronDispatcherBincount" else "bounded"
    for name in CATALOG
}

DEEPEP_REGION: dict[str, tuple[bool, str]] = {
    "BincountTolistIndexAdd": (True, "every slot sent once, weighted sum after"),
    "TorchtitanDispatcherBincount": (True, "every slot sent once, weighted sum after"),
    "MegatronDispatcherBincount": (True, "every slot sent once, weighted sum after"),
    "Llama4ScoresBeforeBincount": (True, "weights before the experts (on the sender), plain sum after"),
    "DeepSeekV3GroupLimitedBincount": (True, "every slot sent once, weighted sum after (ids from grouped top-k)"),
    "FlatBSKViewBincount": (True, "every slot sent once, weighted sum over K after"),
    "ReceiverBincountOffsets": (True, "every slot sent once, weighted sum after; only the offsets are recounted"),
    "ScatterAddCountsControl": (True, "every slot sent once, weighted sum after"),
    "HistcCountsControl": (True, "every slot sent once, weighted sum after"),
    "BincountCapacityDropping": (False, "a deliberate negative: slots over the capacity are dropped on the sender "
                                        "(clamped counts), so not every slot is sent; a rewrite must refuse it"),
}


def build(name: str, group: dist.ProcessGroup, dim: int = 64, experts: int = 8, top_k: int = 2,
          seed: int = 0) -> EPBlock:
    """The block `name` holding this rank's experts of one full init (identical on every rank)."""
    cls, _ = CATALOG[name]
    return cls(group, full_weights(dim, experts, seed), top_k)
