"""Scatter-adds of rows into zeros as moepass::segment_sum_rows (inductor_stage/segment_sums.py, ops/rows/).

On CPU with `segment_sums.devices: "all"` (the op's torch path; the Triton kernel: test_segment_sum_triton_interpreted
and tests/gpu/test_segment_sum_gpu.py): which spellings the rewrite takes, forward and backward, which it leaves, that
values and gradients stay those of eager PyTorch, and that the default leaves CPU graphs to Inductor."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, compile_caches_off

import moepass
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.ops.rows.segment_sum import segment_sum_rows

D = 16


def _compiled_ops(fn, args, devices: str) -> tuple[object, dict]:
    """fn compiled by moepass (no pass of the pipeline, only the Inductor stage), run forward and backward: its
    outputs and the moepass ops each compiled graph holds."""
    with moepass.collecting() as report, compile_caches_off():
        out = torch.compile(fn, backend="moepass", options={"passes": [], "segment_sums.devices": devices})(*args)
        sum(o.sum() for o in out).backward()
    return out, {c["kind"]: c["ops"].get("moepass.segment_sum_rows", 0) for c in report.compiled}


def _combines(x, y, idx):
    n = x.shape[0] + 3  # not x's shape: the zeros of the backward's sums (x's rows) stay apart from these
    added = torch.zeros(n, D).index_add(0, idx, y)
    scattered = torch.zeros(n, D).scatter_add(0, idx[:, None].expand(-1, D), y * 2)
    put = torch.zeros(n, D, dtype=torch.float64)
    put.index_put_((idx,), y.double() / 3, accumulate=True)
    into_x = x.clone().index_add(0, idx, y)  # adds into x, not zeros: left to Inductor
    return added + scattered + put.float(), into_x


def _gathers(x, idx):
    return (x[idx] * x.index_select(0, idx % x.shape[0]),)  # index_select takes no negative index


def _inputs(low: int = 0):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, D, generator=gen, requires_grad=True)
    y = torch.randn(30, D, generator=gen, requires_grad=True)
    return x, y, torch.randint(low, 10, (30,), generator=gen)


def test_combine_spellings_become_segment_sums_with_eager_values():
    x, y, idx = _inputs()
    out, counts = _compiled_ops(_combines, (x, y, idx), "all")
    # index_add and index_put_ of the same rows are one sum after AOTAutograd's CSE; scatter_add's is another;
    # the float64 sum of y / 3 is a third; x.clone().index_add stays Inductor's
    assert counts == {"forward": 3, "backward": 0}, counts
    grads = [x.grad.clone(), y.grad.clone()]
    x.grad = y.grad = None
    expected = _combines(x, y, idx)
    sum(o.sum() for o in expected).backward()
    for got, want in zip([*out, *grads], [*expected, x.grad, y.grad]):
        torch.testing.assert_close(got, want)


def test_gather_backwards_become_segment_sums_and_the_default_leaves_cpu_graphs():
    x, _, idx = _inputs(low=-10)  # x[idx] takes negative indices; its backward's index_put counts them from the end
    (out,), counts = _compiled_ops(_gathers, (x, idx), "all")
    assert counts == {"forward": 0, "backward": 2}, counts  # the gradients of x[idx] and of index_select
    got = x.grad.clone()
    x.grad = None
    _gathers(x, idx)[0].sum().backward()
    torch.testing.assert_close(out, _gathers(x, idx)[0])
    torch.testing.assert_close(got, x.grad)
    for devices in ("cuda", "none"):  # the default, cuda: CUDA graphs only
        assert _compiled_ops(_gathers, (x, idx), devices)[1] == {"forward": 0, "backward": 0}


def test_torchtitans_deterministic_scatter_add_becomes_a_segment_sum():
    """torchtitan's combine (LocalTokenDispatcher.combine): its own op over zeros, the index expanded over the
    columns."""
    pytest.importorskip("torchtitan")
    from torchtitan.ops.scatter_add import deterministic_scatter_add

    def combine(x, y, idx):
        return (deterministic_scatter_add(torch.zeros_like(x), idx.reshape(-1, 1).expand(-1, D), y),)

    x, y, idx = _inputs()
    (out,), counts = _compiled_ops(combine, (x, y, idx), "all")
    assert counts == {"forward": 1, "backward": 0}, counts
    grad = y.grad.clone()
    y.grad = None
    combine(x, y, idx)[0].sum().backward()
    torch.testing.assert_close(out, combine(x, y, idx)[0])
    torch.testing.assert_close(grad, y.grad)


def _routed(x, w, scores, top_k: int = 2):
    """An MoE's permute and combine as models/moe.py writes them: slots sorted by expert, token = slot // top_k."""
    expert_of_slot = scores.topk(top_k, dim=-1).indices.view(-1)
    token_of_slot = torch.argsort(expert_of_slot, stable=True) // top_k
    rows = (x[token_of_slot] @ w).float()
    return (torch.zeros(x.shape[0], w.shape[1]).index_add(0, token_of_slot, rows),)


def test_sums_along_a_routing_permutation_become_fused_gather_sums():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(12, D, generator=gen, requires_grad=True)
    w = torch.randn(D, D, generator=gen, requires_grad=True)
    scores = torch.randn(12, 4, generator=gen)
    with moepass.collecting() as report, compile_caches_off():
        compiled = torch.compile(_routed, backend="moepass",
                                 options={"passes": [], "segment_sums.permutations": "gather"})
        (out,) = compiled(x, w, scores)
        out.sum().backward()
    counts = {c["kind"]: c["ops"].get("moepass.permutation_gather_sum", 0) for c in report.compiled}
    assert counts == {"forward": 1, "backward": 1}, counts  # the combine; the gradient of x[token_of_slot]
    assert "2 scatter-add(s) of rows as gather-sums along a routing permutation" in report.summary()
    grads = [x.grad.clone(), w.grad.clone()]
    x.grad = w.grad = None
    (expected,) = _routed(x, w, scores)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, [x.grad, w.grad]):
        torch.testing.assert_close(got, want)


def test_an_index_that_is_no_permutation_stays_with_the_segment_sums():
    def combine(y, idx):  # 24 rows into 12: two a token on average, but any number each
        return (torch.zeros(12, D).index_add(0, idx, y),)

    gen = torch.Generator().manual_seed(3)
    y, idx = torch.randn(24, D, generator=gen, requires_grad=True), torch.randint(0, 12, (24,), generator=gen)
    with moepass.collecting() as report, compile_caches_off():
        torch.compile(combine, backend="moepass", options={
            "passes": [], "segment_sums.permutations": "gather", "segment_sums.devices": "all"})(y, idx)
    assert report.compiled[0]["ops"] == {"moepass.segment_sum_rows": 1}, report.compiled


def test_the_op_sums_rows_by_index_in_fp32_and_rounds_once():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(40, 8, generator=gen).to(torch.bfloat16)
    b = torch.randn(40, 8, generator=gen)
    index = torch.randint(-5, 6, (40,), generator=gen, dtype=torch.int32)
    got = segment_sum_rows([a, b], index, 12, torch.bfloat16)
    expected = torch.zeros(12, 8, dtype=torch.float64).index_put_((index.long(),), a.double() + b.double(),
                                                                accumulate=True)
    assert got.dtype == torch.bfloat16 and got.shape == (12, 8)
    torch.testing.assert_close(got, expected.to(torch.bfloat16), rtol=0, atol=0)  # exact fp32 sums, one rounding
    rows_without_sources = sorted(set(range(12)) - set((index.long() % 12).tolist()))
    assert rows_without_sources and got[rows_without_sources].eq(0).all()


@pytest.mark.parametrize("srcs, index, match", [
    ([], torch.zeros(3, dtype=torch.long), "1 to 4 srcs"),
    ([torch.zeros(3, 2), torch.zeros(3, 3)], torch.zeros(3, dtype=torch.long), "one shape"),
    ([torch.zeros(3, 2)], torch.zeros(4, dtype=torch.long), r"int32 or int64 \[3\]"),
    ([torch.zeros(3, 2)], torch.zeros(3), r"int32 or int64 \[3\]"),
])
def test_the_op_names_what_is_wrong(srcs, index, match):
    with pytest.raises(ValueError, match=match):
        segment_sum_rows(srcs, index, 4, torch.float32)


def test_a_moe_model_step_sums_its_combine_and_gather_gradients_as_segments():
    torch.manual_seed(0)
    model = build_model("debug", **{**TINY, "n_layers": 2})  # one dense, one MoE layer
    tokens = torch.randint(0, TINY["vocab_size"], (2, 32))
    eager = next_token_loss(torch.compile(model, backend="moepass", options={"inductor": False})(tokens), tokens)
    with moepass.collecting() as report, compile_caches_off():
        compiled = torch.compile(model, backend="moepass", options={"segment_sums.devices": "all"})
        loss = next_token_loss(compiled(tokens), tokens)
        loss.backward()
    counts = {c["kind"]: c["ops"].get("moepass.segment_sum_rows", 0) for c in report.compiled}
    # the forward's combine; the backward's sum of the gathered rows' gradients (the dgrads of w1 and w3)
    assert counts == {"forward": 1, "backward": 1}, counts
    assert "inside Inductor: 2 scatter-add(s) of rows as segment sums (1 forward, 1 backward" in report.summary()
    torch.testing.assert_close(loss, eager, rtol=1e-3, atol=1e-3)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
