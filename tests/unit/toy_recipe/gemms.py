"""The toy recipe's six GEMMs: plain matmuls, accumulated in BF16 or in FP32 and rounded once to BF16.

Each records its call in CALLS (real calls only: the families' fake implementations never reach here), so a test can
see which ran and with what settings.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from moepass.ops.lowp.grouped_wgrad_bf16 import as_transposed_layout

KERNELS = ("reference",)
ACCUMULATE = ("bf16", "fp32")
CALLS: list[tuple[str, str, str]] = []  # (gemm, accumulate, kernel) of every call


def check_settings(device: torch.device, grouped: bool, accumulate: str, kernel: str) -> None:
    if accumulate not in ACCUMULATE or kernel not in KERNELS:
        raise ValueError(f"bf16_roundtrip: accumulate={accumulate!r} kernel={kernel!r}; expected one of "
                         f"{ACCUMULATE} and {KERNELS}")


def _mm(a: Tensor, b: Tensor, accumulate: str) -> Tensor:
    return torch.mm(a, b) if accumulate == "bf16" else torch.mm(a.float(), b.float()).to(torch.bfloat16)


def linear_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], accumulate: str, kernel: str) -> Tensor:
    CALLS.append(("linear", accumulate, kernel))
    y = _mm(x.reshape(-1, x.shape[-1]), weight.t(), accumulate)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_dgrad(grad_out: Tensor, weight: Tensor, accumulate: str, kernel: str) -> Tensor:
    CALLS.append(("linear_dgrad", accumulate, kernel))
    grad_x = _mm(grad_out.reshape(-1, grad_out.shape[-1]), weight, accumulate)
    return grad_x.reshape(*grad_out.shape[:-1], weight.shape[1])


def linear_wgrad(grad_out: Tensor, x: Tensor, accumulate: str, kernel: str) -> Tensor:
    CALLS.append(("linear_wgrad", accumulate, kernel))
    return _mm(grad_out.reshape(-1, grad_out.shape[-1]).t(), x.reshape(-1, x.shape[-1]), accumulate)


def _groups(offs: Tensor) -> list[slice]:
    ends = offs.tolist()
    return [slice(begin, end) for begin, end in zip([0, *ends[:-1]], ends)]


def grouped_forward(x: Tensor, w_t: Tensor, offs: Tensor, accumulate: str, kernel: str) -> Tensor:
    """out[g] = x[g] @ w_t[g]; rows at or after offs[-1] belong to no group and stay zero."""
    CALLS.append(("grouped_mm", accumulate, kernel))
    out = x.new_zeros(x.shape[0], w_t.shape[2])
    for e, rows in enumerate(_groups(offs)):
        out[rows] = _mm(x[rows], w_t[e], accumulate)
    return out


def grouped_dgrad(grad_out: Tensor, w_t: Tensor, offs: Tensor, accumulate: str, kernel: str) -> Tensor:
    CALLS.append(("grouped_mm_dgrad", accumulate, kernel))
    grad_x = grad_out.new_zeros(grad_out.shape[0], w_t.shape[1])
    for e, rows in enumerate(_groups(offs)):
        grad_x[rows] = _mm(grad_out[rows], w_t[e].t(), accumulate)
    return grad_x


def grouped_wgrad(grad_out: Tensor, x: Tensor, offs: Tensor, accumulate: str, kernel: str) -> Tensor:
    """grad_w_t[g] = x[g].T @ grad_out[g], in w_t's (transposed) layout."""
    CALLS.append(("grouped_mm_wgrad", accumulate, kernel))
    grad_w_t = x.new_zeros(offs.shape[0], x.shape[1], grad_out.shape[1])
    for e, rows in enumerate(_groups(offs)):
        grad_w_t[e] = _mm(x[rows].t(), grad_out[rows], accumulate)
    return as_transposed_layout(grad_w_t)
