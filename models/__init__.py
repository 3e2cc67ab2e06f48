"""DeepSeek-V3 reference model in plain BF16 PyTorch: the "unmodified user model".

Imports nothing from moepass; moepass's passes must work on it as written.
"""

from __future__ import annotations

import torch.distributed as dist

from .config import FLAVORS, DeepSeekV3Config, get_config
from .deepseek_v3 import DeepSeekV3, TransformerBlock
from .moe import MoE, load_full_state_dict

__all__ = [
    "FLAVORS",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "MoE",
    "TransformerBlock",
    "build_model",
    "get_config",
    "load_full_state_dict",
]


def build_model(flavor: str = "debug", ep_group: dist.ProcessGroup | None = None, **overrides) -> DeepSeekV3:
    """DeepSeekV3 of the named flavor (fields overridable), expert-parallel over ep_group if given."""
    return DeepSeekV3(get_config(flavor, **overrides), ep_group=ep_group)
