"""moepass::ep_dispatch / ep_combine on gloo, 2 and 4 CPU ranks in spawned processes.

The reference backend is checked against expectations built by hand; the DeepEP glue is checked the same
way against a CPU stand-in of ``deep_ep.Buffer`` (its V1 intranode contract), since DeepEP needs GPUs.

Every rank builds every rank's inputs from one seed, so it can construct its expected receive rows
by plain Python loops, with no communication. The rank checks (in helpers.py) take (backend, device) so
that tests/test_ep_ops_gpu.py runs the same checks on NCCL and DeepEP.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch
import torch.distributed as dist

from helpers import (  # noqa: F401  (rank_pool: a fixture)
    EpProblem,
    check_autograd,
    check_combine_of_dispatch_counts_destinations,
    check_combine_sums_in_rank_order,
    check_compiled_matches_eager,
    check_dispatch_semantics,
    combine,
    dispatch,
    make_rank_inputs,
    rank_pool,
)


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


# ---------------------------------------------------------------- a stand-in deep_ep, to run the DeepEP glue on CPU


class StandInConfig:
    def __init__(self, num_sms: int):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return (self.num_sms // 2) * num_ranks * 256 * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


class StandInBuffer:
    """deep_ep.Buffer's V1 intranode contract (handle tuple, cached dispatch, combine with weights) over gloo."""

    num_sms = 20
    created: list["StandInBuffer"] = []

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, *, explicitly_destroy=False):
        assert explicitly_destroy, "moepass must destroy buffers explicitly"
        self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes
        self.destroyed = False
        StandInBuffer.created.append(self)

    def destroy(self):
        assert not self.destroyed
        dist.barrier(self.group)  # the real destroy() is a barrier too
        self.destroyed = True

    @staticmethod
    def get_dispatch_config(num_ranks):
        return StandInConfig(StandInBuffer.num_sms)

    get_combine_config = get_dispatch_config

    def _check_room(self, x):
        assert not self.destroyed
        need = self.get_dispatch_config(0).get_nvl_buffer_size_hint(x.shape[1] * 2, self.group.size())
        assert self.num_nvl_bytes >= need, "buffer too small for these tokens"

    def get_dispatch_layout(self, topk_idx, num_experts):
        assert topk_idx.dtype == torch.int64 and topk_idx.is_contiguous()
        world = self.group.size()
        owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // world), -1)
        is_token_in_rank = (owner.unsqueeze(-1) == torch.arange(world)).any(dim=1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
        return is_token_in_rank.sum(0).to(torch.int32), None, per_expert, is_token_in_rank, None

    def _exchange(self, rows, is_token_in_rank):
        send_token = is_token_in_rank.t().nonzero()[:, 1]
        send = is_token_in_rank.sum(0)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        out = rows.new_empty((int(recv.sum()), *rows.shape[1:]))
        dist.all_to_all_single(out, rows[send_token].contiguous(), recv.tolist(), send.tolist(), group=self.group)
        return out, send, recv

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, **_):
        self._check_room(x)
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            recv_x, _, recv = self._exchange(x, handle[4])
            assert recv_x.shape[0] == handle[3].shape[0]
            return recv_x, None, None, None, None, None
        world, rank = self.group.size(), self.group.rank()
        e_local = num_tokens_per_expert.shape[0] // world
        meta = torch.cat([topk_idx, torch.arange(x.shape[0]).unsqueeze(-1)], dim=1)
        recv_x, send, recv = self._exchange(x, is_token_in_rank)
        recv_meta, _, _ = self._exchange(meta, is_token_in_rank)
        recv_weights_raw, _, _ = self._exchange(topk_weights, is_token_in_rank)
        recv_topk_idx = torch.where(
            (recv_meta[:, :-1] >= 0) & (recv_meta[:, :-1] // e_local == rank), recv_meta[:, :-1] - rank * e_local, -1
        )
        recv_topk_weights = torch.where(recv_topk_idx >= 0, recv_weights_raw, 0.0)
        counts = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=e_local).tolist()
        sent_by_rank = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(sent_by_rank, send, group=self.group)
        matrix = torch.stack(sent_by_rank)  # [i][j]: rows rank i sends to rank j
        channels = torch.zeros(world, self.num_sms // 2, dtype=torch.int32)
        send_head = torch.where(is_token_in_rank, 0, -1).to(torch.int32)
        handle = (matrix.cumsum(0).to(torch.int32), channels, channels.clone(), recv_meta[:, -1].to(torch.int32),
                  is_token_in_rank, send_head)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle, None

    def combine(self, x, handle, topk_weights=None, **_):
        self._check_room(x)
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and x.shape[0] == handle[3].shape[0]
        is_token_in_rank = handle[4]
        outs = []
        for rows in (x, topk_weights):
            if rows is None:
                outs.append(None)
                continue
            send = is_token_in_rank.sum(0)
            recv = torch.diff(handle[0][:, self.group.rank()], prepend=torch.zeros(1, dtype=torch.int32))
            back = rows.new_empty((int(send.sum()), *rows.shape[1:]))
            dist.all_to_all_single(back, rows.contiguous(), send.tolist(), recv.tolist(), group=self.group)
            total = torch.zeros((is_token_in_rank.shape[0], *rows.shape[1:]))
            send_token = is_token_in_rank.t().nonzero()[:, 1]
            start = 0
            for count in send.tolist():
                total[send_token[start:start + count]] += back[start:start + count].float()
                start += count
            outs.append(total.to(rows.dtype))
        return outs[0], outs[1], None


def stand_in_deep_ep():
    module = types.ModuleType("deep_ep")
    module.__spec__ = importlib.machinery.ModuleSpec("deep_ep", None)
    module.Buffer, module.topk_idx_t, module.__version__ = StandInBuffer, torch.int64, "stand-in"
    return module


def with_stand_in_deep_ep(rank, world_size, check, *args):
    """Run check with `import deep_ep` giving the stand-in, then put everything back."""
    from moepass.ops.ep import deepep as ep_deepep

    sys.modules["deep_ep"] = stand_in_deep_ep()
    ep_deepep._import_deep_ep.cache_clear()
    try:
        check(rank, world_size, *args)
    finally:
        ep_deepep.release_deepep_buffers()
        del sys.modules["deep_ep"]
        ep_deepep._import_deep_ep.cache_clear()
        StandInBuffer.created.clear()


def check_buffer_reused_and_grown(rank, world_size):
    from moepass.ops.ep import deepep as ep_deepep

    for hidden in (16, 64, 16):
        problem = EpProblem(world_size, hidden=hidden)
        x, topk_idx, topk_weights = make_rank_inputs(problem)[rank]
        recv_x, *_, handle = dispatch(x, topk_idx, topk_weights, problem, "deepep")
        combine(recv_x, handle, "deepep")
    first, grown = StandInBuffer.created
    assert first.destroyed and not grown.destroyed and list(ep_deepep._buffers.values()) == [grown]
    assert grown.num_nvl_bytes == StandInConfig(StandInBuffer.num_sms).get_nvl_buffer_size_hint(64 * 2, world_size)


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
def test_deepep_glue_against_stand_in_buffer(check, rank_pool):
    """moepass's DeepEP path (handle passing, cached dispatch, fakes) on a CPU stand-in of deep_ep.Buffer."""
    rank_pool(4 if check is check_combine_sums_in_rank_order else 2).run(with_stand_in_deep_ep, check, "deepep", "cpu")


def test_deepep_buffer_is_reused_and_grown_for_wider_tokens(rank_pool):
    rank_pool(2).run(with_stand_in_deep_ep, check_buffer_reused_and_grown)
