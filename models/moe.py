"""DeepSeek MoE: group-limited top-k router, grouped routed experts, shared experts.

Shape letters: T tokens, D dim, E experts, K top-k, N = T*K routed rows, F expert hidden.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import expert_parallel as ep
from .config import DeepSeekV3Config
from .feed_forward import FeedForward, trunc_normal_


class TopKRouter(nn.Module):
    """Token-choice top-k over sigmoid/softmax scores, DeepSeek-V3 `Gate` semantics.

    `expert_bias` is the aux-loss-free balancing bias: it shifts which experts are chosen,
    never the weights given to them.
    """

    def __init__(self, config: DeepSeekV3Config):
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.top_k = config.n_activated_experts
        self.n_groups = config.n_expert_groups
        self.n_limited_groups = config.n_limited_groups
        self.score_func = config.score_func
        self.route_norm = config.route_norm
        self.route_scale = config.route_scale
        self.gate = nn.Linear(config.dim, self.n_experts, bias=False, dtype=config.dtype)
        self.register_buffer("expert_bias", torch.zeros(self.n_experts, dtype=torch.float32), persistent=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> routing weights [T, K] (fp32) and expert ids [T, K] (int64)."""
        logits = self.gate(x).float()  # scores in fp32: selection must not hinge on bf16 rounding
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores + self.expert_bias
        if self.n_groups > 1:
            choice = self._keep_limited_groups(choice)
        expert_ids = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(-1, expert_ids)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, expert_ids

    def _keep_limited_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (-inf) every expert outside each token's n_limited_groups best groups."""
        grouped = choice.unflatten(-1, (self.n_groups, -1))
        if self.score_func == "softmax":
            group_scores = grouped.amax(dim=-1)  # DeepSeek-V2
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # DeepSeek-V3
        kept = torch.topk(group_scores, self.n_limited_groups, dim=-1).indices
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter(-1, kept, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).flatten(-2)


def _grouped_mm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: BF16 inside an autocast region (torch._grouped_mm's one low-precision
    dtype), else x's."""
    return torch.bfloat16 if torch.is_autocast_enabled(x.device.type) else x.dtype


class GroupedExperts(nn.Module):
    """SwiGLU experts as 3-D weights, run with torch._grouped_mm over expert-major rows.

    Under expert parallelism the module holds only this rank's experts:
    global ids [ep_rank * E_local, (ep_rank + 1) * E_local).
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, dtype: torch.dtype, ep_rank: int = 0, ep_size: int = 1):
        super().__init__()
        first, last = ep.local_expert_range(n_experts, ep_rank, ep_size)
        self.n_global_experts = n_experts
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.w1 = nn.Parameter(torch.empty(last - first, hidden_dim, dim, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(last - first, dim, hidden_dim, dtype=dtype))
        self.w3 = nn.Parameter(torch.empty(last - first, hidden_dim, dim, dtype=dtype))

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [R, D] sorted by local expert, tokens_per_expert [E_local] -> [R, D] in x's dtype.

        Under autocast the GEMMs run in BF16 with their operands cast here, as torchtitan's experts cast them:
        autocast does not cast torch._grouped_mm. Elsewhere they run in x's dtype, uncast."""
        offs = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)  # group ends
        dtype = _grouped_mm_dtype(x)
        w1, w2, w3 = (w if w.dtype == dtype else w.to(dtype) for w in (self.w1, self.w2, self.w3))
        x_e = x if x.dtype == dtype else x.to(dtype)
        gate = torch._grouped_mm(x_e, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x_e, w3.transpose(-2, -1), offs=offs)
        out = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def shard_(self, ep_rank: int, ep_size: int) -> None:
        """Keep only ep_rank's experts of a full (unsharded) module."""
        if self.ep_size != 1:
            raise ValueError("experts are already sharded for expert parallelism")
        for name in ("w1", "w2", "w3"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(ep.shard_experts(full.detach(), ep_rank, ep_size)))
        self.ep_rank, self.ep_size = ep_rank, ep_size

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.w1, std)
        trunc_normal_(self.w2, out_std)
        trunc_normal_(self.w3, out_std)


class MoE(nn.Module):
    def __init__(self, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.n_experts = config.n_routed_experts
        self.top_k = config.n_activated_experts
        self.router = TopKRouter(config)
        # with a group, allocate only this rank's experts (the full set may not fit)
        ep_rank, self.ep_size = ep.ep_rank_and_size(ep_group) if ep_group is not None else (0, 1)
        self.ep_group = ep_group
        self.experts = GroupedExperts(
            config.n_routed_experts, config.dim, config.moe_inter_dim, config.dtype, ep_rank, self.ep_size
        )
        self.shared_experts = FeedForward(config.dim, config.n_shared_experts * config.moe_inter_dim, config.dtype)

    def set_ep_group(self, group: dist.ProcessGroup) -> None:
        """Switch to expert parallelism over `group`, keeping this rank's slice of the experts."""
        ep_rank, ep_size = ep.ep_rank_and_size(group)
        self.experts.shard_(ep_rank, ep_size)
        self.ep_group, self.ep_size = group, ep_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        weights, expert_ids = self.router(x)  # [T, K]

        # permute (token, k) slots to expert-major order; stable keeps token order per expert
        expert_of_slot = expert_ids.view(-1)  # [N]
        slot_order = torch.argsort(expert_of_slot, stable=True)
        token_of_slot = slot_order // self.top_k
        # fixed-size count (no bincount/nonzero): shapes stay static for the compiler
        tokens_per_expert = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add(
            0, expert_of_slot, torch.ones_like(expert_of_slot)
        )
        routed_input = x[token_of_slot]  # [N, D]

        if self.ep_group is None:
            routed_output = self.experts(routed_input, tokens_per_expert)
        else:
            local_input, tokens_per_local_expert, state = ep.dispatch(
                routed_input, tokens_per_expert, self.ep_group, self.ep_size
            )
            routed_output = ep.combine(self.experts(local_input, tokens_per_local_expert), state, self.ep_group)

        # routing weights are applied here, after the experts and after combine; product and
        # sum over a token's K experts are done in fp32, rounded to the model dtype once
        slot_weights = weights.view(-1)[slot_order]  # [N] fp32
        weighted = routed_output.float() * slot_weights.unsqueeze(-1)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add(0, token_of_slot, weighted)
        return (routed.to(x.dtype) + self.shared_experts(x)).view(shape)

    def init_weights(self, std: float, out_std: float) -> None:
        trunc_normal_(self.router.gate.weight, out_std)  # torchtitan depth-scales the gate
        self.router.expert_bias.zero_()
        self.experts.init_weights(std, out_std)
        self.shared_experts.init_weights(std, out_std)


def load_full_state_dict(module: nn.Module, full_state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Load a full (non-EP) state dict into `module`, slicing expert weights to each rank's experts."""
    state_dict = dict(full_state_dict)
    for prefix, sub in module.named_modules():
        if isinstance(sub, GroupedExperts) and sub.ep_size > 1:
            for name in ("w1", "w2", "w3"):
                key = f"{prefix}.{name}" if prefix else name
                if key in state_dict:
                    state_dict[key] = ep.shard_experts(state_dict[key], sub.ep_rank, sub.ep_size)
    module.load_state_dict(state_dict, strict=strict)
