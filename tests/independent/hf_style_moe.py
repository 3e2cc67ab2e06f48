"""A small DeepSeek-V3-style decoder written the way HF transformers 5.x writes it.

Independent of moepass.models: passes are checked against a model whose source they have
never seen. Module paths, weight layouts and the routed-expert math follow
transformers' DeepseekV3 (experts_implementation="grouped_mm"):

  model.embed_tokens, model.layers.N.self_attn.{q_a_proj,q_a_layernorm,q_b_proj | q_proj,
  kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, model.layers.N.mlp.{gate_proj,
  up_proj, down_proj} (dense) or model.layers.N.mlp.{gate, experts, shared_experts} (MoE),
  model.norm, lm_head.
  experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I], fed to torch._grouped_mm as
  `w.transpose(-2, -1)` views with int32 cumulative offsets; router logits are an fp32 F.linear.

Import: this folder has no __init__.py; put it on sys.path
(`sys.path.insert(0, str(Path(__file__).parent / "independent"))`) and `import hf_style_moe`.
Self-test: `python tests/independent/hf_style_moe.py`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass
class TinyDeepseekConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    moe_intermediate_size: int = 128
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1
    num_attention_heads: int = 4
    q_lora_rank: int | None = 64
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 32
    v_head_dim: int = 32
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 as HF does; the product is taken back in the input dtype.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(seq_len: int, dim: int, theta: float, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: TinyDeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.num_heads = cfg.num_attention_heads
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_out = self.num_heads * self.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, s, self.num_heads, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = torch.split(q, [cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)

        latent, k_rope = torch.split(self.kv_a_proj_with_mqa(x), [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(b, s, self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim).transpose(1, 2)
        k_nope, v = torch.split(kv, [cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k_rope = k_rope.view(b, 1, s, cfg.qk_rope_head_dim)

        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope, cos, sin).expand(-1, self.num_heads, -1, -1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.qk_head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopkRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k; gate weights come from raw scores."""

    def __init__(self, cfg: TinyDeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        x = x.view(-1, cfg.hidden_size)
        # The router runs in fp32 whatever the model dtype: HF casts both operands.
        logits = F.linear(x.type(torch.float32), self.weight.type(torch.float32))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = cfg.n_routed_experts // cfg.n_group
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, cfg.n_group, per_group).reshape(-1, cfg.n_routed_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        topk_idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        topk_weight = scores.gather(1, topk_idx)
        if cfg.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, topk_weight * cfg.routed_scaling_factor


def grouped_swiglu(tokens: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Expert-sorted tokens [S, H] -> [S, H]; offsets are int32 cumulative group ends."""
    h = torch._grouped_mm(tokens, gate_up_proj.transpose(-2, -1), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down_proj.transpose(-2, -1), offs=offsets)


class GroupedExperts(nn.Module):
    def __init__(self, cfg: TinyDeepseekConfig, num_experts: int | None = None):
        super().__init__()
        self.num_experts = cfg.n_routed_experts if num_experts is None else num_experts
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inter))

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        top_k = topk_idx.shape[-1]
        flat_expert = topk_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        source_token = order // top_k
        # One-hot sum, not bincount: its output shape does not depend on the data.
        tokens_per_expert = F.one_hot(flat_expert, self.num_experts).sum(dim=0)
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        out = grouped_swiglu(x[source_token], self.gate_up_proj, self.down_proj, offsets)
        # Weighting and the per-token sum happen in fp32, as in HF (fp32 router weights).
        weighted = out.float() * topk_weight.reshape(-1)[order].unsqueeze(-1)
        combined = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, source_token, weighted)
        return combined.to(x.dtype)


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: TinyDeepseekConfig):
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = GroupedExperts(cfg)
        self.shared_experts = SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_idx, topk_weight = self.gate(x)
        routed = self.experts(x.view(-1, x.shape[-1]), topk_idx, topk_weight).view(x.shape)
        return routed + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyDeepseekConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_idx < cfg.first_k_dense_replace:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        else:
            self.mlp = DeepseekMoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: TinyDeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(input_ids.shape[1], self.cfg.qk_rope_head_dim, self.cfg.rope_theta, h.dtype, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.norm(h)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: TinyDeepseekConfig):
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(input_ids))


def causal_lm_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, in fp32 as HF's loss does."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


def loss_fn(model: DeepseekForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    return causal_lm_loss(model(input_ids), input_ids)


def init_weights(model: nn.Module, std: float) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, std)
            elif isinstance(module, (TopkRouter, GroupedExperts)):
                for p in module.parameters():
                    p.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def build(seed: int = 0, dtype: torch.dtype = torch.bfloat16, **config_overrides) -> DeepseekForCausalLM:
    """The tiny model, deterministic in `seed`; parameters (and buffers) in `dtype`."""
    cfg = TinyDeepseekConfig(**config_overrides)
    torch.manual_seed(seed)
    model = DeepseekForCausalLM(cfg)
    init_weights(model, cfg.initializer_range)
    return model.to(dtype)


def example_input_ids(cfg: TinyDeepseekConfig, batch: int = 2, seq: int = 64, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)


def loop_experts_reference(experts: GroupedExperts, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
    """Per-expert Python loop (HF's "eager" experts): the meaning grouped_swiglu must keep."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(experts.num_experts):
        token, slot = torch.where(topk_idx == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, experts.down_proj[e])
        out.index_add_(0, token, y.float() * topk_weight[token, slot, None])
    return out.to(x.dtype)


def _self_test() -> None:
    for q_lora_rank in (64, None):
        model = build(seed=0, q_lora_rank=q_lora_rank)
        ids = example_input_ids(model.cfg)
        loss = loss_fn(model, ids)
        loss.backward()
        assert torch.isfinite(loss), loss
        assert abs(loss.item() - math.log(model.cfg.vocab_size)) < 1.0, loss.item()
        moe = model.model.layers[1].mlp
        for name, p in [("experts.gate_up_proj", moe.experts.gate_up_proj), ("experts.down_proj", moe.experts.down_proj), ("gate.weight", moe.gate.weight)]:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        print(f"q_lora_rank={q_lora_rank}: loss {loss.item():.4f}, expert/router grads non-zero")

    model = build(seed=0, dtype=torch.float32)
    moe = model.model.layers[1].mlp
    x = torch.randn(128, model.cfg.hidden_size)
    idx, w = moe.gate(x)
    grouped = moe.experts(x, idx, w)
    looped = loop_experts_reference(moe.experts, x, idx, w)
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)
    print("grouped_mm experts == per-expert loop (fp32)")


if __name__ == "__main__":
    _self_test()
