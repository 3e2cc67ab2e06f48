"""moepass::ep_pairs_gather / ep_pairs_sum / ep_pairs_weight_grad: eager against float64 math, and the
Inductor decompositions against eager, forward and backward."""

import pytest
import torch

import moepass.ops  # noqa: F401
from moepass.ops.ep_pairs import EP_PAIRS_DECOMPOSITIONS

ops = torch.ops.moepass


def routing(rows: int, topk: int, local_experts: int, seed: int = 0):
    """recv_topk_idx as ep_dispatch returns it: every row has >= 1 local expert, -1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, local_experts, (rows, topk), generator=g)
    idx[:, 0] = torch.randint(0, local_experts, (rows,), generator=g)
    _, pair_slot = ops.ep_expert_major_pairs(idx, local_experts)
    weights = torch.rand(rows, topk, generator=g).masked_fill(idx < 0, 0.0)
    return idx, pair_slot, weights


def dense_gather(x, pair_slot, topk, weights):
    pairs = x.double()[pair_slot // topk]
    return pairs if weights is None else pairs * weights.double().reshape(-1)[pair_slot].unsqueeze(-1)


def dense_sum(y, pair_slot, rows, topk, weights):
    terms = y.double() if weights is None else y.double() * weights.double().reshape(-1)[pair_slot].unsqueeze(-1)
    return torch.zeros(rows, y.shape[1], dtype=torch.float64).index_add(0, pair_slot // topk, terms)


@pytest.mark.parametrize("weighted", [False, True])
def test_gather_and_sum_equal_float64_math_forward_and_backward(weighted):
    rows, topk, hidden = 29, 4, 24
    _, pair_slot, weights = routing(rows, topk, local_experts=5)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = weights.clone().requires_grad_() if weighted else None
    pairs = ops.ep_pairs_gather(x, pair_slot, topk, w)
    out = ops.ep_pairs_sum(pairs * 3, pair_slot, rows, topk, w, torch.float32, False)
    grad = torch.randn(rows, hidden)
    out.backward(grad)

    x64 = x.detach().double().requires_grad_()
    w64 = weights.double().requires_grad_() if weighted else None
    ref_pairs = dense_gather(x64, pair_slot, topk, w64)
    ref = dense_sum((ref_pairs.to(torch.bfloat16) * 3).double(), pair_slot, rows, topk, w64)
    ref.backward(grad.double())
    assert pairs.dtype == torch.bfloat16 and out.dtype == torch.float32
    torch.testing.assert_close(pairs.double(), ref_pairs.detach(), rtol=2**-8, atol=0)
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2**-7, atol=1e-2)
    if weighted:
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-3, atol=1e-3)
        # slots whose expert is on another rank get no gradient
        assert torch.all(w.grad.reshape(-1)[torch.ones(rows * topk, dtype=torch.bool).index_fill(0, pair_slot, False)] == 0)


def test_weight_grad_is_the_dot_at_each_routed_slot_and_zero_elsewhere():
    rows, topk, hidden = 11, 3, 8
    idx, pair_slot, _ = routing(rows, topk, local_experts=4, seed=3)
    pairs = torch.randn(pair_slot.numel(), hidden)
    row_values = torch.randn(rows, hidden)
    got = ops.ep_pairs_weight_grad(pairs, row_values, pair_slot, topk)
    want = torch.zeros(rows * topk)
    for p, slot in enumerate(pair_slot.tolist()):
        want[slot] = pairs[p] @ row_values[slot // topk]
    torch.testing.assert_close(got, want.view(rows, topk))
    assert torch.all(got[idx < 0] == 0)


def _compile_with_decompositions(fn, seen):
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    table = {**select_decomp_table(), **EP_PAIRS_DECOMPOSITIONS}

    def audit(graph):
        seen.append({str(n.target) for n in graph.nodes if n.op == "call_function"})

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, decompositions=table,
                          config_patches={"post_grad_custom_post_pass": audit, "fx_graph_cache": False})
    return torch.compile(fn, backend=backend, dynamic=True)


def test_inductor_decompositions_match_eager_forward_and_backward():
    rows, topk, hidden = 53, 6, 32
    _, pair_slot, weights = routing(rows, topk, local_experts=7, seed=5)

    def round_trip(x, w, pair_slot):
        pairs = ops.ep_pairs_gather(x, pair_slot, topk, None)
        y = pairs * 2  # stands in for the experts (exact: Inductor may skip a rounding to bf16, eager may not)
        return ops.ep_pairs_sum(y, pair_slot, x.shape[0], topk, w, torch.float32, False)

    x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = weights.clone().requires_grad_()
    grad = torch.randn(rows, hidden)
    want = round_trip(x, w, pair_slot)
    want.backward(grad)
    want_gx, want_gw = x.grad, w.grad
    x.grad = w.grad = None

    seen = []
    got = _compile_with_decompositions(round_trip, seen)(x, w, pair_slot)
    got.backward(grad)
    # the same code traced: equal up to the order of the fp32 (atomic on GPU) adds
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.float(), want_gx.float(), rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(w.grad, want_gw, rtol=1e-4, atol=1e-4)
    assert len(seen) == 2, "expected one forward and one backward graph"
    targets = set().union(*seen)
    assert not any("moepass.ep_pairs" in t for t in targets), targets  # decomposed: Inductor fuses them


def test_empty_rank_gives_empty_results():
    x = torch.zeros(0, 16, dtype=torch.bfloat16, requires_grad=True)
    slot = torch.zeros(0, dtype=torch.int64)
    out = ops.ep_pairs_sum(ops.ep_pairs_gather(x, slot, 2, None), slot, 0, 2, None, torch.bfloat16, False)
    out.sum().backward()
    assert out.shape == (0, 16) and x.grad.shape == (0, 16)


def test_bad_arguments_name_the_problem():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="pair_slot must be int64"):
        ops.ep_pairs_gather(x, torch.zeros(3, dtype=torch.int32), 2, None)
    with pytest.raises(TypeError, match="weights must be float32"):
        ops.ep_pairs_sum(x, torch.zeros(4, dtype=torch.int64), 4, 2, torch.zeros(4, 2, dtype=torch.bfloat16),
                         torch.float32, False)
