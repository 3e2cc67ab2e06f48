"""The one device-capability probe behind every low-precision kernel choice: which CUDA device, which arch."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class CudaDevice:
    label: str  # "cuda:0"
    capability: tuple[int, int]
    name: str  # torch.cuda.get_device_name

    @property
    def index(self) -> int:
        return int(self.label.split(":")[1])

    @property
    def arch(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def __str__(self) -> str:
        return f"{self.label} is {self.arch} ({self.name})"


def probe(device: torch.device, tensor_cores: str, emulated: str) -> CudaDevice | str:
    """The CUDA device `device` names, or why there is none ("CPU: no <tensor_cores> tensor cores; <emulated>")."""
    if device.type != "cuda":
        return f"{device.type.upper()}: no {tensor_cores} tensor cores; {emulated}"
    if not torch.cuda.is_available():
        return f"{device}: CUDA is not available in this process; {emulated}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return CudaDevice(f"cuda:{index}", tuple(torch.cuda.get_device_capability(index)),
                      torch.cuda.get_device_name(index))
