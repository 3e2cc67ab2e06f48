"""Rotary position embedding with YaRN frequency scaling, in real (cos, sin) form.

Same numbers as DeepSeek's `precompute_freqs_cis` / `apply_rotary_emb`: consecutive
pairs (x[2i], x[2i+1]) rotate together, like `view_as_complex` on the last dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import DeepSeekV3Config


def yarn_inv_freq(config: DeepSeekV3Config) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim/2]; YaRN interpolates the slow ones by rope_factor."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not config.yarn_enabled:
        return inv_freq

    def correction_dim(num_rotations: float) -> float:
        # the pair index whose wavelength fits num_rotations times in the original context
        return dim * math.log(config.original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(config.beta_fast)), 0)
    high = min(math.ceil(correction_dim(config.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    # 0 for fast pairs (kept: extrapolate), 1 for slow pairs (divided by rope_factor: interpolate)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / config.rope_factor * ramp + inv_freq * (1 - ramp)


def yarn_softmax_scale(config: DeepSeekV3Config) -> float:
    """Attention softmax scale: 1/sqrt(qk_head_dim), times YaRN's mscale^2 when YaRN is on."""
    scale = config.qk_head_dim**-0.5
    if config.yarn_enabled:
        mscale = 0.1 * config.mscale * math.log(config.rope_factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class RotaryEmbedding(nn.Module):
    """Holds cos/sin [max_seq_len, rope_dim/2] in fp32; recomputed on init, never checkpointed."""

    def __init__(self, config: DeepSeekV3Config):
        super().__init__()
        self.config = config
        cos, sin = self._precompute()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _precompute(self) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.config.max_seq_len, dtype=torch.float32)
        angles = torch.outer(positions, yarn_inv_freq(self.config))
        return angles.cos(), angles.sin()

    def reset_parameters(self) -> None:
        # buffers built on the meta device need real values once the model is materialized
        cos, sin = self._precompute()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, rope_dim] by position; cos/sin [S, rope_dim/2]. Computed in fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
