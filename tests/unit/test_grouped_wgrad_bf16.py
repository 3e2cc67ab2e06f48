"""moepass::grouped_mm_wgrad_bf16, the BF16 expert weight gradient behind both recipes' `wgrad_bf16` option.

It is an opaque op so that the layouts torch._grouped_mm's CUDA kernel needs for unaligned token groups
are fixed by its own code, not chosen by Inductor (an inline call hit the kernel's alignment assert in
a compiled 16B model on an H200). The GPU half of that is in test_fp8_rowwise_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import moepass.ops  # noqa: F401  (registers torch.ops.moepass.*)
from helpers import OpsCalled, grouped_inputs

ops = torch.ops.moepass


def test_equals_a_per_group_bf16_matmul_and_ignores_tokens_past_the_last_group():
    sizes, trailing = [10, 0, 45, 3], 7
    x, w_t, offs, g = grouped_inputs(sizes, 64, 32, seed=1, trailing_tokens=trailing)
    x[sum(sizes):], g[sum(sizes):] = 1e4, 1e4  # loud: must not reach any group's gradient
    got = ops.grouped_mm_wgrad_bf16(g, x, offs)
    assert got.shape == w_t.shape and got.stride() == w_t.stride()  # w_t's layout: w's grad needs no copy
    start = 0
    for e, size in enumerate(sizes):
        want = (x[start:start + size].float().t() @ g[start:start + size].float())
        torch.testing.assert_close(got[e].float(), want, rtol=1.6e-2, atol=1e-2)
        start += size
    assert not got[1].any()  # the empty group gets an exact zero gradient


def test_fake_matches_real_layout_and_zero_tokens():
    x, w_t, offs, g = grouped_inputs([0, 0], 32, 16, seed=2)
    got = ops.grouped_mm_wgrad_bf16(g, x, offs)
    assert got.shape == (2, 32, 16) and not got.any()
    x, _, offs, g = grouped_inputs([5, 11], 32, 16, seed=3)
    torch.library.opcheck(ops.grouped_mm_wgrad_bf16, (g, x, offs))


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise"])
def test_both_recipes_wgrad_bf16_backward_goes_through_the_op(recipe):
    x, w_t, offs, g = grouped_inputs([10, 0, 54], 64, 64, seed=4)
    x, w_t = x.requires_grad_(), w_t.detach().requires_grad_()
    if recipe == "mxfp8":
        out = ops.mxfp8_grouped_mm(x, w_t, offs, "rceil", True, "emulated")
    else:
        out = ops.fp8_rowwise_grouped_mm(x, w_t, offs, True, "emulated")
    with OpsCalled() as log:
        out.backward(g)
    assert "moepass::grouped_mm_wgrad_bf16" in log.names, log.names
    assert not any(n.endswith("_wgrad") for n in log.names), log.names  # no quantized wgrad ran
    torch.testing.assert_close(w_t.grad, ops.grouped_mm_wgrad_bf16(g, x.detach(), offs))
