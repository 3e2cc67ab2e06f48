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


def test_compiled_combine_and_gather_backward_use_segment_sums_on_cuda_by_default():
    d, tokens, top_k = 256, 64, 4

    def moe_like(x, w, idx):
        y = (x[idx] @ w).float()
        return torch.zeros(tokens, d, device=x.device).index_add(0, idx, y).bfloat16()

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    w = torch.randn(d, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    idx = torch.argsort(torch.randint(0, 8, (tokens * top_k,), device="cuda", generator=gen), stable=True) // top_k
    with moepass.collecting() as report, compile_caches_off():
        out = torch.compile(moe_like, backend="moepass", options={"passes": []})(x, w, idx)
        out.float().sum().backward()
    counts = {c["kind"]: c["ops"].get("moepass.segment_sum_rows", 0) for c in report.compiled}
    assert counts == {"forward": 1, "backward": 1}, counts
    grad = x.grad.clone()
    x.grad = None
    expected = moe_like(x, w, idx)
    expected.float().sum().backward()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, x.grad, rtol=2e-2, atol=2e-2)


def test_compiled_routing_permutation_sums_as_gather_sums_equal_eager():
    """segment_sums.permutations: gather on CUDA: Inductor's Triton reduction over the inverse permutation, fused with
    the GEMM that makes the rows, gives eager's sums."""
    d, tokens, top_k, experts = 256, 64, 4, 8

    def routed(x, w, scores):
        token_of_slot = torch.argsort(scores.topk(top_k, dim=-1).indices.view(-1), stable=True) // top_k
        y = (x[token_of_slot] @ w).float()
        return torch.zeros(tokens, d, device=x.device).index_add(0, token_of_slot, y).bfloat16()

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    w = torch.randn(d, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    scores = torch.randn(tokens, experts, device="cuda", generator=gen)
    with moepass.collecting() as report, compile_caches_off():
        out = torch.compile(routed, backend="moepass",
                            options={"passes": [], "segment_sums.permutations": "gather"})(x, w, scores)
        out.float().sum().backward()
    counts = {c["kind"]: c["ops"].get("moepass.permutation_gather_sum", 0) for c in report.compiled}
    assert counts == {"forward": 1, "backward": 1}, counts
    grad = x.grad.clone()
    x.grad = None
    expected = routed(x, w, scores)
    expected.float().sum().backward()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad, x.grad, rtol=2e-2, atol=2e-2)
