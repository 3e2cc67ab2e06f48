"""Multi-head latent attention (MLA), DeepSeek-V2/V3, in its training ("naive") form.

Queries: wq, or the low-rank wq_a -> q_norm -> wq_b when q_lora_rank > 0.
Keys/values: wkv_a compresses to kv_lora_rank (+ one shared RoPE key of qk_rope_head_dim),
kv_norm, then wkv_b expands per head to the no-RoPE key part and the value.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import DeepSeekV3Config
from .rope import apply_rotary_emb, yarn_softmax_scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, config: DeepSeekV3Config):
        super().__init__()
        self.n_heads = config.n_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.softmax_scale = yarn_softmax_scale(config)
        dim, dtype = config.dim, config.dtype

        if self.q_lora_rank == 0:
            self.wq = nn.Linear(dim, self.n_heads * self.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.wq_a = nn.Linear(dim, self.q_lora_rank, bias=False, dtype=dtype)
            self.q_norm = nn.RMSNorm(self.q_lora_rank, eps=config.norm_eps, dtype=dtype)
            self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, bias=False, dtype=dtype)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope_head_dim, bias=False, dtype=dtype)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=config.norm_eps, dtype=dtype)
        self.wkv_b = nn.Linear(
            self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False, dtype=dtype
        )
        self.wo = nn.Linear(self.n_heads * self.v_head_dim, dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        if self.q_lora_rank == 0:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq_len, self.n_heads, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, rope_cos, rope_sin)

        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # one RoPE key shared by all heads (decoupled RoPE)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), rope_cos, rope_sin)
        kv = self.wkv_b(self.kv_norm(kv)).view(batch, seq_len, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        # SDPA wants [B, H, S, D]; v_head_dim may differ from qk_head_dim
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.softmax_scale
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.v_head_dim))
