"""The toy recipe's one kernel: a plain matmul, accumulated in BF16 or in FP32 and rounded once to BF16.

Every GEMM body records its call in CALLS (real calls only: the families' fake implementations never reach here), so a
test can see which ran and with what settings.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..quant import round_to_bf16

CALLS: list[tuple[str, str, str]] = []  # (gemm, accumulate, kernel) of every call


def mm(a: Tensor, b: Tensor, accumulate: str) -> Tensor:
    return torch.mm(a, b) if accumulate == "bf16" else round_to_bf16(torch.mm(a.float(), b.float()))
