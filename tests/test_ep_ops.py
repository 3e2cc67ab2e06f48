"""moepass::ep_dispatch / ep_combine on gloo, 2 and 4 CPU ranks in spawned processes.

The reference backend is checked against expectations built by hand; the DeepEP glue is checked the same
way against a CPU stand-in of ``deep_ep.Buffer`` (its V1 intranode contract), since DeepEP needs GPUs.

Every rank builds every rank's inputs from one seed, so it can construct its expected receive rows
by plain Python loops, with no communication. The rank checks take (backend, device) so that
tests/test_ep_ops_gpu.py runs the same checks on NCCL and DeepEP.
"""

from __future__ import annotations

import importlib.machinery
import os
import queue as queue_module
import socket
import sys
import time
import traceback
import types
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
CHECK_TIMEOUT_S = 180
SEED = 1234


# ---------------------------------------------------------------- running ranks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_loop(rank, world_size, port, pg_backend, env, tasks, results):
    os.environ.update(env)
    torch.set_num_threads(1)
    if pg_backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        pg_backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        while (task := tasks.get()) is not None:
            check, args = task
            try:
                check(rank, world_size, *args)
                results.put((rank, None))
            except BaseException:
                results.put((rank, traceback.format_exc()))
    finally:
        deepep = sys.modules.get("moepass.ops.ep_deepep")
        if deepep is not None:
            deepep.release_deepep_buffers()
        dist.destroy_process_group()
        results.close()
        results.join_thread()
    os._exit(0)  # interpreter teardown after torch takes seconds per rank; nothing is left to flush


class RankPool:
    """world_size spawned ranks in one process group, kept across checks (spawning costs seconds per rank)."""

    def __init__(self, world_size: int, pg_backend: str = "gloo", env: dict | None = None):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.Queue()
        env = {"OMP_NUM_THREADS": "1", **(env or {})}
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_rank_loop,
                args=(rank, world_size, port, pg_backend, env, self.tasks[rank], self.results),
            )
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self.healthy = True

    def run(self, check, *args, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        """check(rank, world_size, *args) on every rank; any rank's failure or a hang fails the test."""
        for queue in self.tasks:
            queue.put((check, args))
        deadline = time.monotonic() + timeout_s
        failures, done = [], set()
        while len(done) < self.world_size:
            try:
                rank, error = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_module.Empty:
                break
            done.add(rank)
            if error is not None:
                failures.append(f"rank {rank}:\n{error}")
        hung = sorted(set(range(self.world_size)) - done)
        if failures or hung:
            self.healthy = False  # a failed collective leaves the group unusable: the next test respawns
            self.close()
            message = "\n".join(failures)
            pytest.fail(message + (f"\nranks {hung} gave no result within {timeout_s}s (hang)" if hung else ""))

    def close(self) -> None:
        if self.healthy:
            for queue in self.tasks:
                queue.put(None)
            for proc in self.procs:
                proc.join(30)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


class RankPools:
    """A healthy RankPool per world size; a pool broken by a failed check is respawned on next use."""

    def __init__(self, pg_backend: str = "gloo", env: dict | None = None):
        self.pg_backend, self.env = pg_backend, env
        self.pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self.pools.get(world_size)
        if pool is None or not pool.healthy:
            pool = self.pools[world_size] = RankPool(world_size, self.pg_backend, self.env)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="module")
def rank_pool():
    """rank_pool(world_size) -> RankPool of gloo CPU ranks."""
    pools = RankPools()
    yield pools
    pools.close()


# ---------------------------------------------------------------- inputs and expectations


@dataclass
class EpProblem:
    world_size: int
    num_tokens: int = 12
    hidden: int = 16
    topk: int = 3
    num_experts: int = 8

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size


def problem_for(world_size: int, device: str) -> EpProblem:
    """Small on CPU; on CUDA wide enough rows (hidden 256) for DeepEP's 16-byte TMA copies."""
    if device == "cpu":
        return EpProblem(world_size)
    return EpProblem(world_size, num_tokens=64, hidden=256, topk=4, num_experts=16)


def make_rank_inputs(problem: EpProblem, seed: int = SEED, integer_x: bool = False):
    """Every rank's (x bf16, topk_idx int64, topk_weights f32), identical on all ranks.

    Token 0 is routed nowhere, token 1 only to its own rank's experts, token 2 to ranks 0, 1, 2 (those
    that exist), the rest at random with about a quarter of the slots -1.
    """
    gen = torch.Generator().manual_seed(seed)
    p = problem
    inputs = []
    for rank in range(p.world_size):
        if integer_x:
            x = torch.randint(-4, 5, (p.num_tokens, p.hidden), generator=gen).to(torch.bfloat16)
        else:
            x = torch.randn(p.num_tokens, p.hidden, generator=gen).to(torch.bfloat16)
        scores = torch.rand(p.num_tokens, p.num_experts, generator=gen)
        local = slice(rank * p.experts_per_rank, (rank + 1) * p.experts_per_rank)
        scores[1] = -1.0
        scores[1, local] = torch.rand(p.experts_per_rank, generator=gen)
        topk_idx = scores.topk(p.topk, dim=1).indices
        drop = torch.rand(p.num_tokens, p.topk, generator=gen) < 0.25
        drop[0] = True
        drop[1] = False
        topk_idx[1] = torch.where(scores[1].gather(0, topk_idx[1]) >= 0, topk_idx[1], -1)
        topk_idx = torch.where(drop, -1, topk_idx)
        fan_out = [r * p.experts_per_rank for r in range(min(3, p.world_size, p.topk))]
        topk_idx[2] = torch.tensor(fan_out + [-1] * (p.topk - len(fan_out)))
        topk_weights = torch.rand(p.num_tokens, p.topk, generator=gen)
        inputs.append((x, topk_idx, topk_weights))
    return inputs


def destination_ranks(topk_idx_row: list[int], experts_per_rank: int) -> list[int]:
    return sorted({e // experts_per_rank for e in topk_idx_row if e >= 0})


@dataclass
class ExpectedDispatch:
    rows: list[tuple[int, int]]  # (source rank, source token) per received row
    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    num_recv_tokens_per_expert: torch.Tensor
    is_token_in_rank: torch.Tensor


def expected_dispatch(problem: EpProblem, inputs, rank: int) -> ExpectedDispatch:
    p, e_local = problem, problem.experts_per_rank
    rows, xs, idxs, weights = [], [], [], []
    for src, (x, topk_idx, topk_weights) in enumerate(inputs):
        for t in range(p.num_tokens):
            ids = topk_idx[t].tolist()
            if rank not in destination_ranks(ids, e_local):
                continue
            rows.append((src, t))
            xs.append(x[t])
            local = [e - rank * e_local if e >= 0 and e // e_local == rank else -1 for e in ids]
            idxs.append(local)
            weights.append([float(topk_weights[t, k]) if local[k] >= 0 else 0.0 for k in range(p.topk)])
    counts = [sum(row.count(j) for row in idxs) for j in range(e_local)]
    own_idx = inputs[rank][1].tolist()
    in_rank = [[r in destination_ranks(ids, e_local) for r in range(p.world_size)] for ids in own_idx]
    return ExpectedDispatch(
        rows=rows,
        recv_x=torch.stack(xs) if xs else torch.empty(0, p.hidden, dtype=torch.bfloat16),
        recv_topk_idx=torch.tensor(idxs, dtype=torch.int64).reshape(-1, p.topk),
        recv_topk_weights=torch.tensor(weights, dtype=torch.float32).reshape(-1, p.topk),
        num_recv_tokens_per_expert=torch.tensor(counts, dtype=torch.int64),
        is_token_in_rank=torch.tensor(in_rank, dtype=torch.bool),
    )


def sum_in_rank_order(terms: list[torch.Tensor]) -> torch.Tensor:
    """fp32 accumulation starting from +0, one destination rank at a time, then bf16."""
    total = torch.zeros(terms[0].shape, dtype=torch.float32)
    for term in terms:
        total = total + term.float()
    return total.to(torch.bfloat16)


def handle_fields(backend: str, handle) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_token_in_rank, recv_src_idx) from either backend's handle."""
    from moepass.ops import ep_deepep, ep_reference

    layout = ep_deepep if backend == "deepep" else ep_reference
    return handle[layout.HANDLE_IS_TOKEN_IN_RANK], handle[layout.HANDLE_RECV_SRC_IDX]


def dispatch(x, topk_idx, topk_weights, problem: EpProblem, backend: str):
    import moepass.ops.ep_dispatch_combine  # noqa: F401  (registers torch.ops.moepass.ep_*)
    from moepass.ops.ep_dispatch_combine import group_args

    return torch.ops.moepass.ep_dispatch(x, topk_idx, topk_weights, problem.num_experts, *group_args(), backend)


def combine(y, handle, backend: str):
    from moepass.ops.ep_dispatch_combine import group_args

    return torch.ops.moepass.ep_combine(y, handle, *group_args(), backend)


# ---------------------------------------------------------------- rank checks


def check_dispatch_semantics(rank, world_size, backend, device):
    problem = problem_for(world_size, device)
    inputs = make_rank_inputs(problem)
    x, topk_idx, topk_weights = (t.to(device) for t in inputs[rank])
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle = dispatch(x, topk_idx, topk_weights, problem, backend)
    expected = expected_dispatch(problem, inputs, rank)
    assert expected.rows, "the problem should route something to every rank"
    assert torch.equal(recv_x.cpu(), expected.recv_x)
    assert torch.equal(recv_topk_idx.cpu(), expected.recv_topk_idx)
    assert torch.equal(recv_topk_weights.cpu(), expected.recv_topk_weights)
    assert torch.equal(counts.cpu(), expected.num_recv_tokens_per_expert)
    is_token_in_rank, recv_src_idx = handle_fields(backend, handle)
    assert torch.equal(is_token_in_rank.cpu(), expected.is_token_in_rank)
    assert recv_src_idx.cpu().tolist() == [t for _, t in expected.rows]


def check_combine_of_dispatch_counts_destinations(rank, world_size, backend, device):
    problem = problem_for(world_size, device)
    inputs = make_rank_inputs(problem)
    x, topk_idx, topk_weights = (t.to(device) for t in inputs[rank])
    recv_x, *_, handle = dispatch(x, topk_idx, topk_weights, problem, backend)
    out = combine(recv_x, handle, backend).cpu()
    fanout = torch.tensor([len(destination_ranks(ids, problem.experts_per_rank)) for ids in inputs[rank][1].tolist()])
    assert fanout[0] == 0 and fanout.max() > 1, "the problem should cover unrouted and multi-rank tokens"
    assert torch.equal(out, (inputs[rank][0].float() * fanout[:, None]).to(torch.bfloat16))


# Values a receiving rank writes in the rank-order check; 2**30 - 2**30 + 1 is 1 only in rank order.
RANK_VALUES = (2.0**30, -(2.0**30), 1.0, 0.5)
MIXED_SCALES = (1.0, -0.75, 3.0, 0.3)


def check_combine_sums_in_rank_order(rank, world_size, backend, device):
    problem = problem_for(world_size, device)
    inputs = make_rank_inputs(problem)
    x, topk_idx, topk_weights = (t.to(device) for t in inputs[rank])
    recv_x, *_, handle = dispatch(x, topk_idx, topk_weights, problem, backend)
    y_mixed = (recv_x.float() * MIXED_SCALES[rank]).to(torch.bfloat16)
    y_cancel = torch.full_like(recv_x, RANK_VALUES[rank])
    out_mixed = combine(y_mixed, handle, backend).cpu()
    out_cancel = combine(y_cancel, handle, backend).cpu()
    all_dests = [destination_ranks(ids, problem.experts_per_rank) for ids in inputs[rank][1].tolist()]
    if world_size == 4:
        assert any({0, 1, 2} <= set(d) for d in all_dests), "no token where the summation order shows"
    for t, dests in enumerate(all_dests):
        x_t = inputs[rank][0][t]
        mixed = [(x_t.float() * MIXED_SCALES[d]).to(torch.bfloat16) for d in dests]
        cancel = [torch.full_like(x_t, RANK_VALUES[d]) for d in dests]
        want_mixed = sum_in_rank_order(mixed) if dests else torch.zeros_like(x_t)
        want_cancel = sum_in_rank_order(cancel) if dests else torch.zeros_like(x_t)
        assert torch.equal(out_mixed[t], want_mixed), (t, dests)
        assert torch.equal(out_cancel[t], want_cancel), (t, dests)


def weight_cotangent(rank: int, problem: EpProblem, rows) -> torch.Tensor:
    """d loss / d recv_topk_weights on `rank`: small integers, nonzero at the -1 slots too."""
    values = [[float((src * 7 + t * 3 + k + rank) % 5 - 2) for k in range(problem.topk)] for src, t in rows]
    return torch.tensor(values, dtype=torch.float32).reshape(len(rows), problem.topk)


def rank_scale(rank: int) -> float:
    return float(rank + 1) * (-1.0 if rank % 2 else 1.0)


def check_autograd(rank, world_size, backend, device):
    problem = problem_for(world_size, device)
    inputs = make_rank_inputs(problem, integer_x=True)
    x_cpu, topk_idx_cpu, topk_weights_cpu = inputs[rank]
    x = x_cpu.to(device, copy=True).requires_grad_()
    topk_weights = topk_weights_cpu.to(device, copy=True).requires_grad_()
    recv_x, _, recv_topk_weights, _, handle = dispatch(x, topk_idx_cpu.to(device), topk_weights, problem, backend)
    rows = {r: expected_dispatch(problem, inputs, r).rows for r in range(world_size)}
    cotangents = {r: weight_cotangent(r, problem, rows[r]) for r in range(world_size)}
    q = cotangents[rank].to(device)
    gen = torch.Generator().manual_seed(SEED + 1)
    g = [torch.randint(-3, 4, (problem.num_tokens, problem.hidden), generator=gen).float() for _ in range(world_size)]
    out = combine(recv_x * rank_scale(rank), handle, backend)
    loss = (out.float() * g[rank].to(device)).sum() + (recv_topk_weights * q).sum()
    loss.backward()

    # Analytic: d/dx[t] = g[t] * sum of the scales of t's destination ranks; d/dw[t,k] = q at the owner's row.
    want_grad_x = torch.zeros(problem.num_tokens, problem.hidden)
    want_grad_w = torch.zeros(problem.num_tokens, problem.topk)
    for t, ids in enumerate(topk_idx_cpu.tolist()):
        for d in destination_ranks(ids, problem.experts_per_rank):
            want_grad_x[t] += g[rank][t] * rank_scale(d)
        for k, e in enumerate(ids):
            if e < 0:
                continue
            owner = e // problem.experts_per_rank
            want_grad_w[t, k] = cotangents[owner][rows[owner].index((rank, t)), k]
    assert torch.equal(x.grad.cpu(), want_grad_x.to(torch.bfloat16))
    assert torch.equal(topk_weights.grad.cpu(), want_grad_w)


def moe_like_step(x, topk_idx, topk_weights, num_experts, group_size, group_name, backend):
    """Both ops as the pass will emit them: dispatch, scale by routed weight, combine."""
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle = torch.ops.moepass.ep_dispatch(
        x, topk_idx, topk_weights, num_experts, group_size, group_name, backend
    )
    row_weight = recv_topk_weights.sum(dim=1, keepdim=True)
    y = (recv_x.float() * row_weight).to(torch.bfloat16)
    return torch.ops.moepass.ep_combine(y, handle, group_size, group_name, backend)


def check_compiled_matches_eager(rank, world_size, backend, device, compile_backend="aot_eager"):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import compile_fx

    import moepass.ops.ep_dispatch_combine  # noqa: F401
    from moepass.ops.ep_dispatch_combine import group_args

    problem = problem_for(world_size, device)
    graphs = {"dynamo": 0, "fw": [], "bw": []}

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
            return make_boxed_func(gm.forward)

        return compiler

    recording_aot = aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"))

    def counting_backend(gm, example_inputs):
        graphs["dynamo"] += 1
        if compile_backend == "aot_eager":
            return recording_aot(gm, example_inputs)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(moe_like_step, backend=counting_backend, fullgraph=True)
    for seed in (SEED, SEED + 7):  # new routing, new receive sizes: must not recompile
        x_cpu, topk_idx_cpu, topk_weights_cpu = make_rank_inputs(problem, seed=seed, integer_x=True)[rank]
        topk_weights_cpu = (topk_weights_cpu * 4).round() / 4  # exact sums: any fusion order gives the same bits
        g = torch.randint(-3, 4, x_cpu.shape, generator=torch.Generator().manual_seed(seed)).to(device)
        results = []
        for fn in (moe_like_step, compiled):
            x = x_cpu.to(device, copy=True).requires_grad_()
            topk_weights = topk_weights_cpu.to(device, copy=True).requires_grad_()
            out = fn(x, topk_idx_cpu.to(device), topk_weights, problem.num_experts, *group_args(), backend)
            (out.float() * g).sum().backward()
            results.append((out.detach(), x.grad, topk_weights.grad))
        for eager_t, compiled_t in zip(*results):
            torch.testing.assert_close(compiled_t, eager_t, rtol=0, atol=0)
    assert graphs["dynamo"] == 1, f"{graphs['dynamo']} Dynamo graphs: recompiled on new receive sizes"
    if compile_backend == "aot_eager":
        assert "moepass.ep_dispatch.default" in graphs["fw"][0] and "moepass.ep_combine.default" in graphs["fw"][0]
        assert {"moepass.ep_dispatch_cached.default", "moepass.ep_dispatch_backward.default"} <= graphs["bw"][0]


def check_choose_ep_backend(rank, world_size, *_):
    from moepass.ops.ep_dispatch_combine import choose_ep_backend

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
    from moepass.ops import ep_deepep

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
    from moepass.ops import ep_deepep

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

    import moepass.ops.ep_dispatch_combine  # noqa: F401

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
    from moepass.ops.ep_deepep import hidden_unsupported_reason

    got = hidden_unsupported_reason(hidden)
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize(
    "num_experts, backend, error",
    [(7, "reference", ValueError), (8, "nccl", ValueError)],
)
def test_fake_dispatch_rejects_bad_arguments(num_experts, backend, error):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    import moepass.ops.ep_dispatch_combine  # noqa: F401

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
