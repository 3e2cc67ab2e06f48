"""DeepSeek-V3 decoder: embeddings, MLA + (dense FFN | MoE) blocks, final RMSNorm, output head."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .attention import MultiHeadLatentAttention
from .config import DeepSeekV3Config
from .feed_forward import FeedForward, trunc_normal_
from .moe import MoE, load_full_state_dict
from .rope import RotaryEmbedding


def depth_scaled_std(std: float, layer_id: int) -> float:
    """torchtitan's depth init: projections that feed the residual shrink with depth."""
    return std / (2 * (layer_id + 1)) ** 0.5


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps, dtype=config.dtype)
        self.attention = MultiHeadLatentAttention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps, dtype=config.dtype)
        self.moe_enabled = layer_id >= config.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(config, ep_group)
        else:
            self.feed_forward = FeedForward(config.dim, config.inter_dim, config.dtype)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)
        ffn = self.moe if self.moe_enabled else self.feed_forward
        return x + ffn(self.ffn_norm(x))

    def init_weights(self, std: float) -> None:
        out_std = depth_scaled_std(std, self.layer_id)
        for norm in (self.attention_norm, self.ffn_norm):
            nn.init.ones_(norm.weight)
        attention = self.attention
        for module in attention.modules():
            if isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.Linear):
                trunc_normal_(module.weight, out_std if module is attention.wo else std)
        (self.moe if self.moe_enabled else self.feed_forward).init_weights(std, out_std)


class DeepSeekV3(nn.Module):
    """forward(tokens [B, S] int64) -> logits [B, S, vocab_size] in the model dtype."""

    def __init__(self, config: DeepSeekV3Config, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim, dtype=config.dtype)
        self.rope = RotaryEmbedding(config)
        self.layers = nn.ModuleList(TransformerBlock(i, config, ep_group) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps, dtype=config.dtype)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False, dtype=config.dtype)
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rope_cos, rope_sin = self.rope(tokens.shape[1])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, rope_cos, rope_sin)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan-style init: trunc normal(0.02), depth-scaled residual projections, norms 1."""
        std = self.config.init_std
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        self.rope.reset_parameters()
        for layer in self.layers:
            layer.init_weights(std)
        nn.init.ones_(self.norm.weight)
        trunc_normal_(self.output.weight, self.config.dim**-0.5)

    def set_ep_group(self, group: dist.ProcessGroup) -> None:
        """Turn a full model into this rank's expert-parallel shard (experts sliced in place)."""
        for layer in self.layers:
            if layer.moe_enabled:
                layer.moe.set_ep_group(group)

    def load_full_state_dict(self, full_state_dict: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a non-EP checkpoint; expert weights are sliced to this rank's experts."""
        load_full_state_dict(self, full_state_dict, strict=strict)
