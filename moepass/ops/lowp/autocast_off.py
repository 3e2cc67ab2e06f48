"""The low-precision ops' bodies run with autocast off: each op fixes its own precision.

A custom op has no autocast kernel, so an autocast region live around it (a region in the compiled function run
without Inductor, or around the call of an eager graph) would reach the GEMMs inside its body: blockwise's emulated
FP32 GEMM would run in BF16. Compiled graphs run with autocast off already (AOTAutograd's runtime wrapper).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def autocast_off(body: Callable) -> Callable:
    """`body(*args)` with autocast off on the device of its first argument (a tensor)."""

    @functools.wraps(body)
    def run(*args):
        with torch.autocast(args[0].device.type, enabled=False):
            return body(*args)

    return run
