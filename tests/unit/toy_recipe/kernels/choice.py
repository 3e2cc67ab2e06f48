"""Which toy kernel runs where, and why: "reference" (plain torch matmuls) on any device."""

from __future__ import annotations

import torch

KERNELS = ("reference",)
ACCUMULATE = ("bf16", "fp32")


def choose_kernel(requested: str, option: str) -> tuple[str, str]:
    """("reference", reason a user can read) for any device and GEMM kind; `option` names the kernel option."""
    return "reference", f"plain torch matmuls ({option}={requested!r})"


def check_settings(device: torch.device, grouped: bool, accumulate: str, kernel: str) -> None:
    if accumulate not in ACCUMULATE or kernel not in KERNELS:
        raise ValueError(f"bf16_roundtrip: accumulate={accumulate!r} kernel={kernel!r}; expected one of "
                         f"{ACCUMULATE} and {KERNELS}")
