"""Which MXFP8 implementation can run on a device, and why (native sm_100 kernels or emulation), and the torchao
settings the ops pass: kernel preference and scale rounding."""

from __future__ import annotations

import functools

import torch

from moepass.device_arch import probe
from moepass.torchao_import import torchao_import

KERNELS = ("emulated", "sm100")
SCALE_ROUNDINGS = ("rceil", "floor")
EMULATED_FALLBACK = "use kernel='emulated' (torchao emulated MXFP8 numerics, runs on CPU and any CUDA GPU)"


def check_kernel_name(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {KERNELS}: 'sm100' = torchao native MXFP8 kernels, "
                         "'emulated' = torchao emulated numerics")


@functools.cache
def _torchao_kernels_missing() -> str | None:
    """None when torchao's sm_100 MXFP8 kernels (CUDA, Triton, CuTeDSL) loaded, else what is missing."""
    with torchao_import():
        from torchao.prototype.moe_training.kernels.mxfp8 import quant
        from torchao.prototype.mx_formats import kernels as mx_kernels

    cuda_ext = mx_kernels._mxfp8_cuda_kernels_available and quant._mxfp8_cuda_kernels_available
    missing = [name for name, ok in (
        ("torchao MXFP8 CUDA extension", cuda_ext),
        ("Triton MXFP8 cast kernels", mx_kernels._triton_kernels_available),
        ("CuTeDSL quantize kernels (nvidia-cutlass-dsl, apache-tvm-ffi)", quant._mxfp8_cutedsl_kernels_available),
    ) if not ok]
    return ", ".join(missing) or None


def choose_mxfp8_kernel(device: torch.device | str) -> tuple[str, str]:
    """("sm100" | "emulated", reason a user can read) for MXFP8 GEMMs on `device`."""
    cuda = probe(torch.device(device), "MXFP8", "torchao emulated numerics")
    if isinstance(cuda, str):
        return "emulated", cuda
    if cuda.capability[0] != 10:  # torchao's MXFP8 kernels are built for sm_10x only (not sm_90, not sm_120)
        return "emulated", f"{cuda}; native MXFP8 needs sm_100"
    missing = _torchao_kernels_missing()
    if missing:
        return "emulated", f"{cuda} but torchao MXFP8 kernels did not load: {missing}"
    return "sm100", f"{cuda} and torchao MXFP8 kernels loaded"


def require_kernel(kernel: str, device: torch.device) -> None:
    """Raise unless `kernel` names a known implementation that can run on `device`."""
    check_kernel_name(kernel)
    if kernel == "sm100":
        chosen, reason = choose_mxfp8_kernel(device)
        if chosen != "sm100":
            raise RuntimeError(f"kernel='sm100' cannot run here: {reason}. Fallback: {EMULATED_FALLBACK}.")


def kernel_preference(kernel: str):
    """torchao KernelPreference for a kernel name."""
    with torchao_import():
        from torchao.quantization.quantize_.common import KernelPreference

    return KernelPreference.AUTO if kernel == "sm100" else KernelPreference.EMULATED


def scale_mode(scale_rounding: str):
    """torchao ScaleCalculationMode for a scale_rounding name."""
    with torchao_import():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode

    return ScaleCalculationMode(scale_rounding)


def check_scale_rounding(scale_rounding: str) -> None:
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding={scale_rounding!r} is not one of {SCALE_ROUNDINGS} "
                         "(torchao ScaleCalculationMode RCEIL / FLOOR)")


def check_settings(device: torch.device, grouped: bool, scale_rounding: str, kernel: str) -> None:
    """The MXFP8 ops' own arguments, checked on every call (fake ones too)."""
    check_scale_rounding(scale_rounding)
    require_kernel(kernel, device)
