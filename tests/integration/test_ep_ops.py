"""moepass::ep_dispatch / ep_combine on gloo, 2 and 4 CPU ranks in their own processes.

The reference backend is checked against expectations built by hand; moepass's DeepEP code is checked the same
way on the deep_ep double (tests/fixtures/doubles/deep_ep: DeepEP V1's Buffer over gloo), since DeepEP needs GPUs.

Every rank builds every rank's inputs from one seed, so it can construct its expected receive rows
by plain Python loops, with no communication. The rank checks (in helpers.py) take (backend, device) so
that tests/gpu/test_ep_ops_gpu.py runs the same checks on NCCL and DeepEP.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from doubles import with_deep_ep_double
from helpers import (
    EpProblem,
    check_autograd,
    check_combine_of_dispatch_counts_destinations,
    check_combine_sums_in_rank_order,
    check_compiled_matches_eager,
    check_dispatch_semantics,
    combine,
    dispatch,
    expected_dispatch,
    make_rank_inputs,
)
from rank_shared import rank_pool  # noqa: F401  (a fixture)


# ---------------------------------------------------------------- rank checks of this file only


def check_choose_ep_backend(rank, world_size, *_):
    from moepass.ops.ep.dispatch_combine import choose_ep_backend

    name, reason = choose_ep_backend(None, "cpu", 8)
    assert name == "reference" and "cpu" in reason
    assert choose_ep_backend(dist.group.WORLD, "cpu", 8, requested="reference")[0] == "reference"
    with pytest.raises(RuntimeError, match="'deepep' was requested"):
        choose_ep_backend(dist.group.WORLD.group_name, "cpu", 8, requested="deepep")
    with pytest.raises(ValueError, match="auto"):
        choose_ep_backend(None, "cpu", 8, requested="fast")


# ---------------------------------------------------------------- moepass's DeepEP code on the deep_ep double


def check_buffer_reused_and_grown(rank, world_size):
    import deep_ep

    from moepass.ops.ep import deepep as ep_deepep

    made = []
    real_init = deep_ep.Buffer.__init__

    @functools.wraps(real_init)  # keeps the signature moepass inspects (explicitly_destroy)
    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    deep_ep.Buffer.__init__ = recording_init
    try:
        for hidden in (16, 64, 16):
            problem = EpProblem(world_size, hidden=hidden)
            x, topk_idx, topk_weights = make_rank_inputs(problem)[rank]
            recv_x, *_, handle = dispatch(x, topk_idx, topk_weights, problem, "deepep")
            combine(recv_x, handle, "deepep")
    finally:
        deep_ep.Buffer.__init__ = real_init
    first, grown = made
    assert first.runtime is None and grown.runtime is not None and list(ep_deepep._buffers.values()) == [grown]
    configs = (deep_ep.Buffer.get_dispatch_config(world_size), deep_ep.Buffer.get_combine_config(world_size))
    assert grown.num_nvl_bytes == max(c.get_nvl_buffer_size_hint(64 * 2, world_size) for c in configs)
    assert grown.num_rdma_bytes == 0  # within a node DeepEP refuses an RDMA buffer (deep_ep.cpp L160-161)


def check_fp8_dispatch_deepep_bit_equal_to_reference(rank, world_size):
    """ep_dispatch_quantized through DeepEP's FP8 tuple (e4m3 rows, fp32 [T, H/128] scales) against the reference
    backend's FP8 dispatch: the same bits for rows, scales, ids, weights and counts, and the same BF16 gradients."""
    from moepass.ops.ep.dispatch_combine import group_args

    problem = EpProblem(world_size, hidden=256)
    inputs = make_rank_inputs(problem)
    x, topk_idx, topk_weights = inputs[rank]
    for recipe, scale_columns in (("fp8_rowwise", 1), ("blockwise", 2)):
        quantize = getattr(torch.ops.moepass, f"{recipe}_quantize_rows")
        every_rank = [quantize(inp[0], "emulated") for inp in inputs]
        rows = expected_dispatch(problem, inputs, rank).rows
        results = {}
        for backend in ("reference", "deepep"):
            x_leaf, w_leaf = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
            q, scale = every_rank[rank]
            recv_x, recv_q, recv_scale, recv_idx, recv_w, counts, _ = torch.ops.moepass.ep_dispatch_quantized(
                x_leaf, q, scale, topk_idx, w_leaf, problem.num_experts, *group_args(), backend)
            assert recv_scale.shape == (len(rows), scale_columns)
            grad_rows = (recv_idx.float().sum(1, keepdim=True) + 3).expand(-1, problem.hidden).to(torch.bfloat16)
            torch.autograd.backward([recv_x, recv_w], [grad_rows, recv_idx.float() * 0.5 + 1])
            results[backend] = dict(q=recv_q.view(torch.uint8), scale=recv_scale, idx=recv_idx, w=recv_w,
                                    counts=counts, grad_x=x_leaf.grad, grad_w=w_leaf.grad)
        got, want = results["deepep"], results["reference"]
        for name in want:
            assert torch.equal(got[name], want[name]), (recipe, name)
        assert torch.equal(got["q"], torch.stack([every_rank[s][0][t] for s, t in rows]).view(torch.uint8)), recipe
        assert torch.equal(got["scale"], torch.stack([every_rank[s][1][t] for s, t in rows])), recipe


def check_intranode_without_nvshmem(rank, world_size):
    """A DeepEP built without NVSHMEM serves groups within a node: moepass asks it for no RDMA buffer."""
    from doubles import deep_ep_double
    from moepass.ops.ep import deepep as ep_deepep

    with deep_ep_double(nvshmem=False):
        check_dispatch_semantics(rank, world_size, "deepep", "cpu")
        (buffer,) = ep_deepep._buffers.values()
        assert buffer.num_rdma_bytes == 0


# ---------------------------------------------------------------- tests

WORLD_SIZES = [2, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dispatch_rows_order_local_ids_and_counts(world_size, rank_pool):
    rank_pool(world_size).run(check_dispatch_semantics, "reference", "cpu")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_combine_of_dispatch_is_x_times_destination_count(world_size, rank_pool):
    rank_pool(world_size).run(check_combine_of_dispatch_counts_destinations, "reference", "cpu")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_combine_sums_fp32_in_rank_order(world_size, rank_pool):
    rank_pool(world_size).run(check_combine_sums_in_rank_order, "reference", "cpu")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_autograd_grads_of_x_and_topk_weights(world_size, rank_pool):
    rank_pool(world_size).run(check_autograd, "reference", "cpu")


def test_compiled_fullgraph_matches_eager_forward_and_backward(rank_pool):
    rank_pool(2).run(check_compiled_matches_eager, "reference", "cpu")


def test_inductor_compiled_matches_eager(rank_pool):
    rank_pool(2).run(check_compiled_matches_eager, "reference", "cpu", "inductor")


def test_choose_ep_backend_on_cpu(rank_pool):
    rank_pool(2).run(check_choose_ep_backend)


def test_fake_dispatch_gives_unbacked_receive_size_reused_downstream():
    """Tracing needs no process group: R is one unbacked SymInt, and combine/backward sizes come from the handle."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    import moepass.ops.ep.dispatch_combine  # noqa: F401

    with FakeTensorMode(shape_env=ShapeEnv()):
        x = torch.empty(6, 16, dtype=torch.bfloat16)
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle = torch.ops.moepass.ep_dispatch(
            x, torch.empty(6, 2, dtype=torch.int64), torch.empty(6, 2), 8, 2, "unused-at-trace-time", "reference"
        )
        (num_recv,) = free_unbacked_symbols(recv_x.shape[0])
        assert recv_topk_idx.shape[0] == recv_topk_weights.shape[0] == recv_x.shape[0]
        assert tuple(counts.shape) == (4,) and counts.dtype == torch.int64
        out = torch.ops.moepass.ep_combine(recv_x, handle, 2, "unused", "reference")
        assert tuple(out.shape) == (6, 16)
        again = torch.ops.moepass.ep_dispatch_cached(out, handle, 2, "unused", "reference")
        assert free_unbacked_symbols(again.shape[0]) == {num_recv}
        grad_x, grad_w = torch.ops.moepass.ep_dispatch_backward(
            recv_x, recv_topk_weights, handle, 2, "unused", "reference"
        )
        assert tuple(grad_x.shape) == (6, 16) and tuple(grad_w.shape) == (6, 2)


@pytest.mark.parametrize(
    "hidden, reason",
    [(7168, None), (1000, "multiple of 16"), (8192, "limit of 8176")],
)
def test_deepep_hidden_limits(hidden, reason):
    from moepass.ops.ep.deepep import hidden_unsupported_reason

    got = hidden_unsupported_reason(hidden)
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize(
    "num_experts, backend, error",
    [(7, "reference", ValueError), (8, "nccl", ValueError)],
)
def test_fake_dispatch_rejects_bad_arguments(num_experts, backend, error):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import moepass.ops.ep.dispatch_combine  # noqa: F401

    with FakeTensorMode(shape_env=ShapeEnv()), pytest.raises(error):
        torch.ops.moepass.ep_dispatch(
            torch.empty(6, 16), torch.empty(6, 2, dtype=torch.int64), torch.empty(6, 2), num_experts, 2, "g", backend
        )


DEEPEP_GLUE_CHECKS = [
    check_dispatch_semantics,
    check_combine_of_dispatch_counts_destinations,
    check_combine_sums_in_rank_order,
    check_autograd,
    check_compiled_matches_eager,
]


@pytest.mark.parametrize("check", DEEPEP_GLUE_CHECKS, ids=lambda c: c.__name__)
def test_deepep_backend_on_the_deep_ep_double(check, rank_pool):
    """moepass's DeepEP path (deepep.py: buffer, layout, handle, cached dispatch, combine with weights, fakes) on the
    deep_ep double (tests/fixtures/doubles/deep_ep), against the same hand-built expectations as the reference backend."""
    rank_pool(4 if check is check_combine_sums_in_rank_order else 2).run(with_deep_ep_double, check, "deepep", "cpu")


def test_deepep_buffer_is_reused_and_grown_for_wider_tokens(rank_pool):
    rank_pool(2).run(with_deep_ep_double, check_buffer_reused_and_grown)


def test_fp8_dispatch_through_deepep_is_bit_equal_to_the_reference_backends(rank_pool):
    rank_pool(2).run(with_deep_ep_double, check_fp8_dispatch_deepep_bit_equal_to_reference)


def test_deepep_without_nvshmem_serves_a_group_within_a_node(rank_pool):
    rank_pool(2).run(check_intranode_without_nvshmem)


@pytest.mark.parametrize(
    "group_size, local_world_size, ranks, nvshmem, reason",
    [
        (2, 8, None, True, None),
        (8, 8, range(8), False, None),  # within a node NVSHMEM is not needed
        (16, 8, range(16), True, None),
        (32, 8, range(16, 48), True, None),
        (16, 8, range(16), False, "spans 2 nodes, which takes DeepEP's internode kernels, and deep_ep was built "
                                  "without NVSHMEM"),
        (16, 4, range(16), True, "needs 8 ranks of it on each node; this job has 4 ranks per node"),
        (16, 8, range(0, 32, 2), True, "not 8 consecutive ranks per node"),
        (8, 4, range(8), True, "spans more than one node (4 ranks per node)"),
        (12, 8, range(12), True, "DeepEP across nodes supports 16, 24, 32"),
        (6, 8, range(6), True, "DeepEP within a node supports 2, 4 or 8"),
    ],
)
def test_deepep_serves_groups_within_a_node_and_across_nodes_of_8(group_size, local_world_size, ranks, nvshmem,
                                                                   reason, monkeypatch):
    from doubles import deep_ep_double
    from moepass.ops.ep.deepep import deepep_choice, deepep_unsupported_reason

    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
    with deep_ep_double(nvshmem=nvshmem):
        got = deepep_unsupported_reason(group_size, torch.device("cpu"), 4 * group_size,
                                        group_ranks=None if ranks is None else list(ranks))
        if reason is None:
            assert got is None
            mode = "internode" if group_size > 8 else "intranode"
            assert f"{group_size} ranks" in deepep_choice(group_size) and mode in deepep_choice(group_size)
        else:
            assert reason in got, got
    if reason is not None and "NVSHMEM" in reason:
        assert "rebuild DeepEP with NVSHMEM" in got  # the fix, in the report's words


@pytest.mark.parametrize(
    "hidden, group_size, topk, reason",
    [(7168, 16, 8, None), (1000, 16, 8, "multiple of 16"), (7296, 16, 8, "multiple of 256"),
     (8192, 16, 8, "internode limit of 16376")],
)
def test_deepep_internode_hidden_limits(hidden, group_size, topk, reason):
    from moepass.ops.ep.deepep import hidden_unsupported_reason

    got = hidden_unsupported_reason(hidden, group_size, topk)
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize(
    "hidden, scale_columns, dtype, reason",
    [(256, 1, torch.float32, None), (256, 2, torch.float32, None), (256, 8, torch.float32, "1x32 blocks"),
     (192, 1, torch.float32, "not a multiple of 128"), (256, 8, torch.float8_e8m0fnu, "float8_e8m0fnu")],
)
def test_deepep_fp8_scale_layouts(hidden, scale_columns, dtype, reason):
    """DeepEP's FP8 tokens carry one fp32 scale per 128 columns: blockwise's tiles, fp8_rowwise's row scale repeated;
    MXFP8's 1x32 power-of-two scales (e8m0) are not that layout."""
    from moepass.ops.ep.deepep import fp8_scales_unsupported_reason

    got = fp8_scales_unsupported_reason(hidden, scale_columns, dtype)
    assert got is None if reason is None else reason in got


def test_fakes_carry_deepeps_handles_within_a_node_and_across_nodes():
    """Tracing needs no process group: the internode handle has 10 tensors and a second unbacked size (R_rdma);
    combine, cached dispatch and the backward read N and R off either handle; FP8 with scales DeepEP cannot send is
    refused at trace time, not in a kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    from doubles import deep_ep_double

    import moepass.ops.ep.dispatch_combine  # noqa: F401

    ops = torch.ops.moepass
    with deep_ep_double(num_sms=8), FakeTensorMode(shape_env=ShapeEnv()):
        for group_size, hidden, length in ((4, 64, 6), (16, 256, 10)):
            x = torch.empty(6, hidden, dtype=torch.bfloat16)
            ids, weights = torch.empty(6, 2, dtype=torch.int64), torch.empty(6, 2)
            recv_x, _, recv_w, counts, handle = ops.ep_dispatch(x, ids, weights, 32, group_size, "g", "deepep")
            assert len(handle) == length and counts.shape == (32 // group_size,)
            (num_recv,) = free_unbacked_symbols(recv_x.shape[0])
            if group_size == 16:
                assert tuple(handle[2].shape) == (16, 4) and tuple(handle[8].shape) == (6, 2)
                assert handle[7].dtype == torch.uint8 and tuple(handle[7].shape)[1] == 8
                (num_rdma_recv,) = free_unbacked_symbols(handle[9].shape[0])
                assert num_rdma_recv != num_recv and handle[9].shape[1] == 8
            else:
                assert tuple(handle[1].shape) == (4, 4)  # channels = num_sms / 2
            assert tuple(ops.ep_combine(recv_x, handle, group_size, "g", "deepep").shape) == (6, hidden)
            again = ops.ep_dispatch_cached(x, handle, group_size, "g", "deepep")
            assert free_unbacked_symbols(again.shape[0]) == {num_recv}
            grad_x, grad_w = ops.ep_dispatch_backward(recv_x, recv_w, handle, group_size, "g", "deepep")
            assert tuple(grad_x.shape) == (6, hidden) and tuple(grad_w.shape) == (6, 2)
        x = torch.empty(6, 256, dtype=torch.bfloat16)
        q = torch.empty(6, 256, dtype=torch.float8_e4m3fn)
        out = ops.ep_dispatch_quantized(x, q, torch.empty(6, 1), ids, weights, 32, 16, "g", "deepep")
        assert tuple(out[2].shape)[1] == 1 and len(out[6]) == 10
        with pytest.raises(ValueError, match="1x32 blocks"):
            ops.ep_dispatch_quantized(x, q, torch.empty(6, 8), ids, weights, 32, 2, "g", "deepep")


@pytest.mark.parametrize(
    "num_experts, reason",
    [(6, "num_experts=6 is not a multiple of the 4 EP ranks"), (4 * 1025, "exceeds DeepEP's limit of 1024")],
)
def test_deepep_refuses_experts_it_cannot_split(num_experts, reason):
    from doubles import deep_ep_double
    from moepass.ops.ep.deepep import deepep_unsupported_reason

    with deep_ep_double():
        assert reason in deepep_unsupported_reason(4, torch.device("cpu"), num_experts)


def _without_explicitly_destroy(deep_ep):
    deep_ep.Buffer.__init__ = lambda self, group, num_nvl_bytes=0, num_rdma_bytes=0: None


def _without_combine(deep_ep):
    del deep_ep.Buffer.combine


@pytest.mark.parametrize(
    "change, reason",
    [(None, "deep_ep is not installed"), ("import", "deep_ep is installed but fails to import (ImportError: "),
     (_without_explicitly_destroy, "older than 1.2"), (_without_combine, "lacks the V1 normal-mode API (combine)")],
)
def test_why_an_installed_or_missing_deep_ep_cannot_be_used(change, reason, tmp_path, monkeypatch):
    """Each reason the report gives instead of running DeepEP, and the RuntimeError when 'deepep' is requested."""
    import sys

    from doubles import deep_ep_double
    from moepass.ops.ep import deepep

    monkeypatch.setattr(deepep, "DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    if change == "import":  # a build against other CUDA/NCCL libraries
        (tmp_path / "deep_ep").mkdir()
        (tmp_path / "deep_ep" / "__init__.py").write_text("raise ImportError('libnvshmem_host.so.3: not found')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    deepep._import_deep_ep.cache_clear()
    try:
        if callable(change):
            with deep_ep_double() as deep_ep:
                change(deep_ep)
                deepep._import_deep_ep.cache_clear()
                got = deepep.deepep_unsupported_reason(2, torch.device("cpu"), 8)
        else:
            got = deepep.deepep_unsupported_reason(2, torch.device("cpu"), 8)
            with pytest.raises(RuntimeError, match="the 'deepep' EP backend cannot run"):
                deepep.deep_ep_module()
        assert reason in got, got
    finally:
        monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
        deepep._import_deep_ep.cache_clear()


def test_deepep_ops_refuse_tokens_deepep_cannot_move_at_trace_time():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from doubles import deep_ep_double

    import moepass.ops.ep.dispatch_combine  # noqa: F401

    ops = torch.ops.moepass
    with deep_ep_double(), FakeTensorMode(shape_env=ShapeEnv()):
        ids, weights = torch.empty(6, 2, dtype=torch.int64), torch.empty(6, 2)
        with pytest.raises(TypeError, match="takes bfloat16 tokens, got torch.float32"):
            ops.ep_dispatch(torch.empty(6, 64), ids, weights, 8, 2, "g", "deepep")
        with pytest.raises(ValueError, match="hidden=1000 is not a multiple of 16"):
            ops.ep_dispatch(torch.empty(6, 1000, dtype=torch.bfloat16), ids, weights, 8, 2, "g", "deepep")
        x = torch.empty(6, 256, dtype=torch.bfloat16)
        with pytest.raises(TypeError, match="float8_e4m3fn rows, got torch.float8_e5m2"):
            ops.ep_dispatch_quantized(x, torch.empty(6, 256, dtype=torch.float8_e5m2), torch.empty(6, 1), ids, weights,
                                      8, 2, "g", "deepep")
        with pytest.raises(ValueError, match="multiple of 256"):
            ops.ep_dispatch_quantized(torch.empty(6, 384, dtype=torch.bfloat16),
                                      torch.empty(6, 384, dtype=torch.float8_e4m3fn), torch.empty(6, 3), ids, weights,
                                      32, 16, "g", "deepep")
