"""DeepSeek-V3 model configuration: one dataclass, flavors of published numbers.

Field names follow DeepSeek's reference `ModelArgs` (deepseek-ai/DeepSeek-V3,
inference/model.py) so a flavor can be checked line by line against the published
config JSONs in inference/configs/.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class DeepSeekV3Config:
    vocab_size: int
    dim: int
    inter_dim: int  # hidden width of the dense FFN layers
    moe_inter_dim: int  # hidden width of one routed (and one shared) expert
    n_layers: int
    n_dense_layers: int  # the first n_dense_layers use a dense FFN, the rest MoE
    n_heads: int
    # MoE
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int  # top-k
    n_expert_groups: int = 1
    n_limited_groups: int = 1  # groups kept per token before the top-k
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    route_scale: float = 1.0
    route_norm: bool = False  # renormalize top-k weights to sum 1 (DeepSeek-V3 does, with sigmoid)
    # MLA
    q_lora_rank: int = 0  # 0: plain wq, no query low-rank compression
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # RoPE with YaRN (DeepSeek's defaults: 4x the 4096 pretraining context, factor 40)
    max_seq_len: int = 4096 * 4
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    # numerics
    norm_eps: float = 1e-6
    init_std: float = 0.02
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        problems = []
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(f"score_func must be 'softmax' or 'sigmoid', got {self.score_func!r}")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            problems.append(f"n_dense_layers={self.n_dense_layers} not in [0, n_layers={self.n_layers}]")
        if self.n_routed_experts % self.n_expert_groups:
            problems.append(
                f"n_routed_experts={self.n_routed_experts} not divisible by n_expert_groups={self.n_expert_groups}"
            )
        elif not 1 <= self.n_limited_groups <= self.n_expert_groups:
            problems.append(f"n_limited_groups={self.n_limited_groups} not in [1, n_expert_groups={self.n_expert_groups}]")
        elif self.n_activated_experts > self.n_limited_groups * self.experts_per_group:
            problems.append(
                f"top-k={self.n_activated_experts} exceeds the {self.n_limited_groups * self.experts_per_group} "
                "experts left after group limiting"
            )
        # sigmoid group scores sum each group's top-2 experts
        if self.n_expert_groups > 1 and self.score_func == "sigmoid" and self.experts_per_group < 2:
            problems.append("sigmoid group-limited routing needs at least 2 experts per group")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotated in pairs)")
        if problems:
            raise ValueError("invalid DeepSeekV3Config: " + "; ".join(problems))

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_enabled(self) -> bool:
        # DeepSeek applies YaRN only when the model is run past its pretraining context
        return self.max_seq_len > self.original_seq_len


FLAVORS: dict[str, DeepSeekV3Config] = {
    # Small enough for CPU tests, yet every feature is on: dense + MoE layers, shared expert,
    # group-limited sigmoid routing with route norm and scale, YaRN. Every linear and expert
    # K/N is a multiple of 32 (MXFP8 blocks) except the router gate's N = n_routed_experts.
    "debug": DeepSeekV3Config(
        vocab_size=2048,
        dim=256,
        inter_dim=512,
        moe_inter_dim=128,
        n_layers=4,
        n_dense_layers=1,
        n_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        n_activated_experts=2,
        n_expert_groups=2,
        n_limited_groups=1,
        score_func="sigmoid",
        route_scale=2.5,
        route_norm=True,
        q_lora_rank=0,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
    ),
    # DeepSeek-V2-Lite: DeepSeek-V3 inference/configs/config_16B.json; matches torchtitan
    # deepseek_v3 `_16b` except mscale (torchtitan 0.70, DeepSeek's JSON 0.707; we follow DeepSeek).
    "16B": DeepSeekV3Config(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        n_routed_experts=64,
        n_shared_experts=2,
        n_activated_experts=6,
        score_func="softmax",
        route_scale=1.0,
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=0.707,
    ),
    # DeepSeek-V2: DeepSeek-V3 inference/configs/config_236B.json; torchtitan `_236b` agrees.
    "236B": DeepSeekV3Config(
        vocab_size=102400,
        dim=5120,
        inter_dim=12288,
        moe_inter_dim=1536,
        n_layers=60,
        n_dense_layers=1,
        n_heads=128,
        n_routed_experts=160,
        n_shared_experts=2,
        n_activated_experts=6,
        n_expert_groups=8,
        n_limited_groups=3,
        score_func="softmax",
        route_scale=16.0,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
    # DeepSeek-V3: inference/configs/config_671B.json (route_norm from the reference Gate,
    # which renormalizes sigmoid weights); torchtitan `_671b` agrees.
    "671B": DeepSeekV3Config(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=8,
        n_expert_groups=8,
        n_limited_groups=4,
        score_func="sigmoid",
        route_scale=2.5,
        route_norm=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
    ),
}


def get_config(flavor: str = "debug", **overrides) -> DeepSeekV3Config:
    """The named flavor with `overrides` replacing fields; unknown names raise ValueError."""
    if flavor not in FLAVORS:
        raise ValueError(f"unknown DeepSeek-V3 flavor {flavor!r}; valid flavors: {sorted(FLAVORS)}")
    fields = {f.name for f in dataclasses.fields(DeepSeekV3Config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown DeepSeekV3Config field(s) {unknown}; valid fields: {sorted(fields)}")
    return dataclasses.replace(FLAVORS[flavor], **overrides)
