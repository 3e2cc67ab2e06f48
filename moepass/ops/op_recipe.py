"""What a low-precision recipe brings to the shared op families (linear.py, grouped_mm.py): data, not code paths.

A recipe names its ops (moepass::<name>_linear, <name>_grouped_mm and their _dgrad / _wgrad), declares its
own settings (arguments before `wgrad_bf16` and `kernel` in every schema), checks them and the kernel for a
device, and sets the multiple K and N must be. Its op files (mxfp8_linear.py, fp8_rowwise_grouped_mm.py, ...)
hand each family the recipe and its three GEMM bodies (RecipeGemms); the families register the ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .gemm_args import check_multiple


@dataclasses.dataclass(frozen=True)
class RecipeGemms:
    """One GEMM kind's forward, dgrad and wgrad, called after the family's checks as f(*tensors, *settings, kernel)."""

    forward: Callable
    dgrad: Callable
    wgrad: Callable


@dataclasses.dataclass(frozen=True)
class OpRecipe:
    name: str  # "mxfp8", "fp8_rowwise": the ops' name prefix
    settings: tuple[str, ...]  # schema of its own arguments, e.g. ("str scale_rounding",)
    multiple: int  # K and N must be multiples of it
    multiple_why: str  # for the error message
    check_settings: Callable[..., None]  # (device, grouped, *settings, kernel): raises on a bad value or kernel

    def op_name(self, gemm: str) -> str:
        """gemm: "linear", "linear_dgrad", "grouped_mm_wgrad", ... -> the op's name under torch.ops.moepass."""
        return f"{self.name}_{gemm}"

    def op(self, gemm: str):
        return getattr(torch.ops.moepass, self.op_name(gemm))

    def check_dims(self, op: str, **dims: int) -> None:
        check_multiple(op, self.multiple, self.multiple_why, **dims)

    def check(self, device: torch.device, grouped: bool, args: tuple) -> None:
        """args: (*settings, kernel), as every backward GEMM op takes them."""
        self.check_settings(device, grouped, *args)


def split_forward_args(args: tuple) -> tuple[tuple, bool]:
    """A forward op's trailing (*settings, wgrad_bf16, kernel) -> ((*settings, kernel), wgrad_bf16)."""
    *settings, wgrad_bf16, kernel = args
    return (*settings, kernel), wgrad_bf16


def define_op(name: str, params: list[str], check: Callable, compute: Callable, output: Callable):
    """Register moepass::<name>(params) -> Tensor. Real: check, then compute; fake: check, then an empty `output`
    (so a bad call fails at compile time). All three take the op's arguments."""

    def impl(*args):
        check(*args)
        return compute(*args)

    def fake(*args):
        check(*args)
        return output(*args)

    op = torch.library.custom_op(f"moepass::{name}", impl, mutates_args=(), schema=f"({', '.join(params)}) -> Tensor")
    op.register_fake(fake)
    return op
