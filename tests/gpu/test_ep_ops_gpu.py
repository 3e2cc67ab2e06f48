"""EP ops on 2 GPUs over NCCL: the reference backend, and DeepEP against the same expectations and the reference.

Needs 2+ CUDA GPUs (conftest skips `multigpu` otherwise); the DeepEP tests also need `deep_ep` importable.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import (  # noqa: F401  (nccl_ranks: a fixture)
    SEED,
    check_autograd,
    check_combine_of_dispatch_counts_destinations,
    check_combine_sums_in_rank_order,
    check_compiled_matches_eager,
    check_dispatch_semantics,
    handle_fields,
    make_rank_inputs,
    nccl_ranks,
    problem_for,
)

pytestmark = pytest.mark.multigpu

needs_deep_ep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")

SEMANTIC_CHECKS = [
    check_dispatch_semantics,
    check_combine_of_dispatch_counts_destinations,
    check_combine_sums_in_rank_order,
    check_autograd,
    check_compiled_matches_eager,
]


@pytest.mark.parametrize("check", SEMANTIC_CHECKS, ids=lambda c: c.__name__)
def test_reference_backend_on_nccl(check, nccl_ranks):
    nccl_ranks(2).run(check, "reference", "cuda")


@needs_deep_ep
@pytest.mark.parametrize("check", SEMANTIC_CHECKS, ids=lambda c: c.__name__)
def test_deepep_backend_meets_the_same_expectations(check, nccl_ranks):
    nccl_ranks(2).run(check, "deepep", "cuda")


def check_deepep_equals_reference(rank, world_size, hidden):
    from moepass.ops.ep.dispatch_combine import group_args

    problem = problem_for(world_size, "cuda")
    problem.hidden = hidden
    x_cpu, topk_idx_cpu, topk_weights_cpu = make_rank_inputs(problem)[rank]
    gen = torch.Generator().manual_seed(SEED + rank)
    results = {}
    for backend in ("reference", "deepep"):
        x = x_cpu.cuda().requires_grad_()
        topk_weights = topk_weights_cpu.cuda().requires_grad_()
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle = torch.ops.moepass.ep_dispatch(
            x, topk_idx_cpu.cuda(), topk_weights, problem.num_experts, *group_args(), backend
        )
        if "y_scale" not in results:  # one random per-row factor, reused by both backends
            results["y_scale"] = torch.randn(recv_x.shape[0], 1, generator=gen).cuda()
            results["q"] = torch.randn(recv_topk_weights.shape, generator=gen).cuda()
            results["g"] = torch.randn(problem.num_tokens, problem.hidden, generator=gen).cuda()
        y = (recv_x.float() * results["y_scale"]).to(torch.bfloat16)
        out = torch.ops.moepass.ep_combine(y, handle, *group_args(), backend)
        ((out.float() * results["g"]).sum() + (recv_topk_weights * results["q"]).sum()).backward()
        is_token_in_rank, recv_src_idx = handle_fields(backend, handle)
        results[backend] = dict(
            recv_x=recv_x, recv_topk_idx=recv_topk_idx, recv_topk_weights=recv_topk_weights, counts=counts,
            is_token_in_rank=is_token_in_rank, recv_src_idx=recv_src_idx, out=out,
            grad_x=x.grad, grad_w=topk_weights.grad,
        )
    # Two ranks: every sum has at most two terms, so fp32 order cannot matter and all of it is bitwise.
    for name, want in results["reference"].items():
        got = results["deepep"][name]
        assert got.dtype == want.dtype and torch.equal(got, want), f"{name} differs between deepep and reference"


@needs_deep_ep
def test_deepep_equals_reference_forward_and_backward(nccl_ranks):
    nccl_ranks(2).run(check_deepep_equals_reference, 256)


@needs_deep_ep
def test_deepep_buffer_grows_for_wider_tokens_and_is_reused(nccl_ranks):
    for hidden in (256, 1024, 256):
        nccl_ranks(2).run(check_deepep_equals_reference, hidden)
    nccl_ranks(2).run(check_one_buffer_per_group, 1024)


def check_one_buffer_per_group(rank, world_size, widest_hidden):
    from moepass.ops.ep import deepep as ep_deepep
    from moepass.ops.ep.dispatch_combine import group_args

    assert list(ep_deepep._buffers) == [group_args()[1]]
    buffer_cls = ep_deepep.deep_ep_module().Buffer
    configs = (buffer_cls.get_dispatch_config(world_size), buffer_cls.get_combine_config(world_size))
    want = max(c.get_nvl_buffer_size_hint(widest_hidden * 2, world_size) for c in configs)
    assert ep_deepep._buffers[group_args()[1]].num_nvl_bytes == want


def check_choose_ep_backend_picks_deepep(rank, world_size):
    from moepass.ops.ep.dispatch_combine import choose_ep_backend

    name, reason = choose_ep_backend(None, "cuda", 16)
    assert name == "deepep" and "2 ranks" in reason, reason
    name, reason = choose_ep_backend(None, "cuda", 15)
    assert name == "reference" and "multiple" in reason, reason
    name, reason = choose_ep_backend(None, "cuda", 16, hidden=1000)
    assert name == "reference" and "hidden=1000" in reason, reason


@needs_deep_ep
def test_choose_ep_backend_picks_deepep_on_nvlink_pair(nccl_ranks):
    nccl_ranks(2).run(check_choose_ep_backend_picks_deepep)


def check_real_deepep_equals_the_double(rank, world_size):
    """examples/compare_deepep_double.py on NCCL: the installed deep_ep.Buffer and the CPU double CI runs on, output
    for output (rows, order, ids, counts, every handle tensor, combine sums, the FP8 tuple)."""
    from helpers import load_example

    import torch.distributed as dist

    compare = load_example("compare_deepep_double")
    real, double = compare.load_implementation("deep_ep"), compare.load_implementation("double")
    rows = compare.compare(real, double, dist.group.WORLD, torch.device("cuda", rank), hidden=7168, num_tokens=512,
                           num_experts=64, num_topk=8, seed=0)
    assert all(row["agree"] for row in rows), [row for row in rows if not row["agree"]]


@needs_deep_ep
def test_real_deepep_equals_the_double(nccl_ranks):
    nccl_ranks(2).run(check_real_deepep_equals_the_double, timeout_s=300)
