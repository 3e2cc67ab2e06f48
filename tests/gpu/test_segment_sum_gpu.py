"""moepass::segment_sum_rows on CUDA (the Triton kernel): sums equal to an fp64 sum rounded once, the same bits on
every run, a compiled MoE-style combine and gather whose scatter-adds become segment sums by default on CUDA, and the
opt-in gather-sums along a routing permutation."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_caches_off

import moepass
from moepass.ops.rows.segment_sum import segment_sum_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("m, d, n, srcs", [(4096, 7168, 512, 1), (3000, 2049, 700, 2), (17, 5, 40, 3), (0, 64, 8, 1)])
def test_kernel_sums_in_fp32_rounds_once_and_repeats_bit_for_bit(m, d, n, srcs):
    gen = torch.Generator(device="cuda").manual_seed(m + d)
    rows = [torch.randn(m, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(srcs)]
    index = torch.randint(-n, n, (m,), device="cuda", generator=gen)
    got = segment_sum_rows(rows, index, n, torch.bfloat16)
    exact = torch.zeros(n, d, dtype=torch.float64, device="cuda").index_put_(
        (index,), sum(r.double() for r in rows), accumulate=True)
    # fp32 sums of at most a few dozen BF16 values: within one BF16 rounding of the exact sum
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-5)
    assert torch.equal(got, segment_sum_rows(rows, index, n, torch.bfloat16))  # a fixed order: the same bits
    cpu = segment_sum_rows([r.cpu() for r in rows], index.cpu(), n, torch.bfloat16)
    torch.testing.assert_close(got.cpu(), cpu, rtol=2 ** -7, atol=1e-5)  # the torch path's index_add, same sums


D, TOKENS, TOP_K, EXPERTS = 256, 64, 4, 8


def _routed(x, w, scores, token_of_slot=None):
    """An MoE's permute and combine; token_of_slot None: computed here, so its sort is in the graph."""
    if token_of_slot is None:
        token_of_slot = torch.argsort(scores.topk(TOP_K, dim=-1).indices.view(-1), stable=True) // TOP_K
    y = (x[token_of_slot] @ w).float()
    return torch.zeros(TOKENS, D, device=x.device).index_add(0, token_of_slot, y).bfloat16()


@pytest.mark.parametrize("options, op, sort_in_graph", [
    ({}, "segment_sum_rows", False),  # the default on CUDA: the Triton kernel
    ({"segment_sums.permutations": "gather"}, "permutation_gather_sum", True),  # Inductor's fused reduction
])
def test_compiled_combine_and_gather_backward_sums_equal_eager(options, op, sort_in_graph):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    w = torch.randn(D, D, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    scores = torch.randn(TOKENS, EXPERTS, device="cuda", generator=gen)
    index = None if sort_in_graph else torch.argsort(
        scores.topk(TOP_K, dim=-1).indices.view(-1), stable=True) // TOP_K
    with moepass.collecting() as report, compile_caches_off():
        out = torch.compile(_routed, backend="moepass", options={"passes": [], **options})(x, w, scores, index)
        out.float().sum().backward()
    counts = {c["kind"]: c["ops"].get(f"moepass.{op}", 0) for c in report.compiled}
    assert counts == {"forward": 1, "backward": 1}, counts  # the combine; the gradient of x[token_of_slot]
    grad = x.grad.clone()
    x.grad = None
    expected = _routed(x, w, scores, index)
    expected.float().sum().backward()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, x.grad, rtol=2e-2, atol=2e-2)
