"""Which FP8-rowwise implementation can run on a device, and why: torch._scaled_(grouped_)mm, or emulation.

"scaled_mm": GEMMs on FP8 tensor cores through torch._scaled_mm (sm_89+) and torch._scaled_grouped_mm (its
CUTLASS kernel is sm_90 only); e4m3 quantization fused by Inductor from plain torch when compiled
(decomp), else eager torch (linears) or Triton kernels (torchao's and ours, grouped GEMMs).
"emulated": the same quantization in plain torch, exact dequantization, a BF16 GEMM; runs anywhere.
"""

from __future__ import annotations

import functools

import torch

from moepass.device_arch import probe

KERNELS = ("emulated", "scaled_mm")
EMULATED_FALLBACK = ("use kernel='emulated' (the same rowwise e4m3 quantization in plain torch, exact "
                     "dequantization and a BF16 GEMM; runs on CPU and any CUDA GPU)")


def check_kernel_name(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}: 'scaled_mm' = torch._scaled_mm / "
                         "_scaled_grouped_mm on FP8 tensor cores, 'emulated' = the same numerics in plain torch")


def _triton_available() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def choose_fp8_rowwise_kernel(device: torch.device | str, grouped: bool) -> tuple[str, str]:
    """("scaled_mm" | "emulated", reason a user can read) for a linear (grouped=False) or grouped GEMM."""
    cuda = probe(torch.device(device), "FP8", "rowwise FP8 numerics emulated")
    if isinstance(cuda, str):
        return "emulated", cuda
    if grouped and cuda.capability[0] != 9:  # torch's rowwise FP8 grouped GEMM is a CUTLASS sm_90a kernel
        return "emulated", f"{cuda}; torch._scaled_grouped_mm rowwise needs sm_90"
    if not grouped and cuda.capability < (8, 9):
        return "emulated", f"{cuda}; FP8 tensor cores need sm_89 or newer"
    if not _triton_available():
        return "emulated", f"{cuda} but Triton is unavailable for the FP8 quantization kernels"
    gemm = "torch._scaled_grouped_mm" if grouped else "torch._scaled_mm"
    return "scaled_mm", f"{cuda}: {gemm} on FP8 tensor cores, Triton rowwise quantization"


@functools.lru_cache(maxsize=None)
def _choice_on(device: torch.device, grouped: bool) -> tuple[str, str]:
    return choose_fp8_rowwise_kernel(device, grouped)


def require_kernel(kernel: str, device: torch.device, grouped: bool) -> None:
    """Raise unless `kernel` names a known implementation that can run on `device` (checked on every op call)."""
    check_kernel_name(kernel)
    if kernel == "scaled_mm":
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        chosen, reason = _choice_on(device, grouped)  # cached: a device's capability does not change
        if chosen != "scaled_mm":
            raise RuntimeError(f"kernel='scaled_mm' cannot run here: {reason}. Fallback: {EMULATED_FALLBACK}.")


def check_settings(device: torch.device, grouped: bool, kernel: str) -> None:
    """The FP8-rowwise ops' own arguments (their kernel alone), checked on every call (fake ones too)."""
    require_kernel(kernel, device, grouped=grouped)
