"""What several test files share: ranks in spawned processes, EP op checks, GEMM op numerics, stand-ins.

Test files import from here, never from each other (tests/ is on sys.path: the rootdir conftest puts it there).
Sections: ranks (gloo or NCCL process groups kept across checks); EP dispatch/combine problems and the rank
checks tests/test_ep_ops.py runs on gloo and tests/test_ep_ops_gpu.py on NCCL and DeepEP; GEMM op inputs,
fp32 references and accuracy checks shared by the MXFP8 and FP8-rowwise op tests; CPU stand-ins for FP8
kernels; a tiny DeepSeek-V3 for the harness tests.
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

BF16 = torch.bfloat16
ops = torch.ops.moepass  # resolved on use: test files import moepass.ops, which registers the ops


# ---------------------------------------------------------------- ranks in spawned processes

COLLECTIVE_TIMEOUT_S = 60
CHECK_TIMEOUT_S = 180


def free_port() -> int:
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
        deepep = sys.modules.get("moepass.ops.ep.deepep")
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
        port = free_port()
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


# NVLink multicast (NVLS) is off on the lent H200 machines; NCCL, NVSHMEM and symmetric memory must not try it.
NVLS_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.fixture(scope="module")
def nccl_ranks():
    """nccl_ranks(2) -> RankPool of NCCL ranks, one GPU each."""
    pools = RankPools("nccl", NVLS_OFF_ENV)
    yield pools
    pools.close()


# ---------------------------------------------------------------- EP dispatch/combine: problems and rank checks
# Each check takes (backend, device): test_ep_ops.py runs them on gloo, test_ep_ops_gpu.py on NCCL and DeepEP.

SEED = 1234


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
    """Small on CPU; on CUDA wide enough rows (hidden 256) for DeepEP's 16-byte TMA copies. Past 8 ranks (DeepEP across
    nodes: rows in 512-byte units) hidden 256 and two experts a rank."""
    if device == "cpu":
        return EpProblem(world_size) if world_size <= 8 else EpProblem(world_size, hidden=256,
                                                                       num_experts=2 * world_size)
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


def handle_fields(backend: str, handle) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(is_token_in_rank, recv_src_idx) from either backend's handle; DeepEP's internode handle (10 tensors) keeps no
    source token index: None there."""
    from moepass.ops.ep import deepep, reference

    if backend != "deepep":
        return handle[reference.HANDLE_IS_TOKEN_IN_RANK], handle[reference.HANDLE_RECV_SRC_IDX]
    names = deepep.INTERNODE_HANDLE if len(handle) == len(deepep.INTERNODE_HANDLE) else deepep.INTRANODE_HANDLE
    fields = dict(zip(names, handle))
    return fields["is_token_in_rank"], fields.get("recv_src_idx")


def dispatch(x, topk_idx, topk_weights, problem: EpProblem, backend: str):
    import moepass.ops.ep.dispatch_combine  # noqa: F401  (registers torch.ops.moepass.ep_*)
    from moepass.ops.ep.dispatch_combine import group_args

    return torch.ops.moepass.ep_dispatch(x, topk_idx, topk_weights, problem.num_experts, *group_args(), backend)


def combine(y, handle, backend: str):
    from moepass.ops.ep.dispatch_combine import group_args

    return torch.ops.moepass.ep_combine(y, handle, *group_args(), backend)


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
    if recv_src_idx is not None:  # DeepEP across nodes: the rows' order above is what it keeps
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

    import moepass.ops.ep.dispatch_combine  # noqa: F401
    from moepass.ops.ep.dispatch_combine import group_args

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


# ---------------------------------------------------------------- GEMM op numerics (MXFP8 and FP8-rowwise tests)

# Bars for the default RCEIL recipe; FLOOR saturates blocks whose amax/scale lands in (448, 512).
MXFP8_SQNR_BARS = {"rceil": (27.0, 25.0, 24.0), "floor": (25.0, 24.0, 23.0)}  # (out, grad input, grad weight) dB
FP8_ROWWISE_SQNR_BARS = (25.0, 23.0, 23.0)  # (out, grad input, grad weight) dB, the bars


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    ref = ref.double()
    return (20 * torch.log10(ref.norm() / (ref - out.double()).norm())).item()


def _torchao():
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    return _to_mxfp8_then_scaled_mm, _to_mxfp8_then_scaled_grouped_mm, ScaleCalculationMode, KernelPreference


def linear_inputs(x_shape, n, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(*x_shape, generator=gen).to(device, BF16)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, BF16)
    grad_out = torch.randn(*x_shape[:-1], n, generator=gen).to(device, BF16)
    return x, w, grad_out


def grouped_inputs(group_sizes, k, n, seed, device="cpu", trailing_tokens=0):
    """x [M, K], w_t = w.transpose(-2, -1) as torchtitan passes it, offs int32, grad_out [M, N]."""
    gen = torch.Generator().manual_seed(seed)
    m = sum(group_sizes) + trailing_tokens
    x = torch.randn(m, k, generator=gen).to(device, BF16)
    w_t = (torch.randn(len(group_sizes), n, k, generator=gen) / k**0.5).to(device, BF16).transpose(-2, -1)
    offs = torch.tensor(group_sizes).cumsum(0).to(device, torch.int32)
    grad_out = torch.randn(m, n, generator=gen).to(device, BF16)
    return x, w_t, offs, grad_out


def block_inputs(seed):
    x, w, _ = linear_inputs((2, 20, 64), 64, seed=seed)
    _, w_t, offs, g = grouped_inputs([5, 0, 30], 64, 32, seed=seed + 1, trailing_tokens=5)
    return x, w, torch.randn(64).to(BF16), w_t, offs, g


def forward_backward(fn, grad_out, *tensors):
    """fn(*leaves) and d(fn . grad_out)/d(leaves) for fresh leaf copies of `tensors` (None passes through)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.backward(grad_out)
    return (out.detach(), *[t.grad for t in leaves if t is not None and t.is_floating_point()])


def mxfp8_op_linear(x, w, grad_out, scale_rounding="rceil", wgrad_bf16=False, kernel="emulated"):
    return forward_backward(lambda a, b: ops.mxfp8_linear(a, b, None, scale_rounding, wgrad_bf16, kernel),
                            grad_out, x, w)


def mxfp8_op_grouped(x, w_t, offs, grad_out, scale_rounding="rceil", wgrad_bf16=False, kernel="emulated"):
    return forward_backward(lambda a, b, o: ops.mxfp8_grouped_mm(a, b, o, scale_rounding, wgrad_bf16, kernel),
                            grad_out, x, w_t, offs)


def fp8_rowwise_op_linear(x, w, grad_out, wgrad_bf16=False, kernel="emulated"):
    return forward_backward(lambda a, b: ops.fp8_rowwise_linear(a, b, None, wgrad_bf16, kernel), grad_out, x, w)


def fp8_rowwise_op_grouped(x, w_t, offs, grad_out, wgrad_bf16=False, kernel="emulated"):
    return forward_backward(lambda a, b, o: ops.fp8_rowwise_grouped_mm(a, b, o, wgrad_bf16, kernel),
                            grad_out, x, w_t, offs)


def torchao_linear(x, w, grad_out, scale_rounding="rceil", wgrad_bf16=False):
    mm, _, mode, pref = _torchao()
    return forward_backward(lambda a, b: mm(a, b, pref.EMULATED, mode(scale_rounding), wgrad_with_hp=wgrad_bf16),
                            grad_out, x, w)


def torchao_grouped(x, w_t, offs, grad_out, scale_rounding="rceil", wgrad_bf16=False):
    _, gmm, mode, pref = _torchao()
    # offs by keyword: the task notes torchao 0.18 returns None for a positional offs.
    return forward_backward(lambda a, b: gmm(a, b, offs=offs, kernel_preference=pref.EMULATED,
                                             scale_calculation_mode=mode(scale_rounding), wgrad_with_hp=wgrad_bf16,
                                             pad_token_groups_for_grouped_mm=True), grad_out, x, w_t)


def linear_reference(x, w, grad_out):
    """fp32 out, grad_x, grad_w of x @ w.T from the bf16 inputs."""
    x2, w, g2 = x.float().reshape(-1, x.shape[-1]), w.float(), grad_out.float().reshape(-1, w.shape[0])
    return (x2 @ w.T).reshape(grad_out.shape), (g2 @ w).reshape(x.shape), g2.T @ x2


def grouped_reference(x, w_t, offs, grad_out):
    """fp32 out, grad_x, grad_w_t of torch._grouped_mm(x, w_t, offs=offs); tokens past offs[-1] give zeros."""
    x, w_t, grad_out = x.float(), w_t.float(), grad_out.float()
    out, grad_x, grad_w_t = torch.zeros_like(grad_out), torch.zeros_like(x), torch.zeros_like(w_t)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w_t[e]
        grad_x[start:end] = grad_out[start:end] @ w_t[e].T
        grad_w_t[e] = x[start:end].T @ grad_out[start:end]
        start = end
    return out, grad_x, grad_w_t


def assert_sqnr(refs, outs, bars, what):
    values = [sqnr(r, o) for r, o in zip(refs, outs)]
    for name, value, bar in zip(("out", "grad input", "grad weight"), values, bars):
        assert value >= bar, f"{what}: {name} SQNR {value:.2f} dB < {bar} dB"
    return values


def assert_all_equal(got, want, what: str = ""):
    for name, g, w in zip(("out", "grad input", "grad weight"), got, want):
        where = f"{what}: " if what else ""
        assert torch.equal(g, w), f"{where}{name} differs, max |diff| {(g.float() - w.float()).abs().max()}"


def recording_backend(graphs):
    """A backend that keeps AOTAutograd's forward and backward graphs in graphs["fw"] / graphs["bw"]."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def compiler(kind):
        def record(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return record

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))
    return backend


def call_targets(gm):
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


class OpsCalled(TorchDispatchMode):
    """Records the name ("ns::op") of every op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


# shapes the MXFP8 accuracy tests run on CPU and on CUDA
MXFP8_LINEAR_SHAPES = [((64, 64), 96), ((2, 48, 128), 64), ((50, 256), 256), ((7, 32), 32)]
MXFP8_GROUPED_SHAPES = [([10, 0, 50, 40], 64, 96), ([32, 64, 0, 1], 128, 64), ([33, 31, 70], 256, 128), ([5], 32, 32)]


# ---------------------------------------------------------------- FP8 kernels on CPU (fixtures)

@pytest.fixture
def scaled_mm_on_cpu(monkeypatch):
    """Let kernel "scaled_mm" pass the ops' checks on CPU (linears run torch._scaled_mm's CPU kernel)."""
    from moepass.ops.lowp.fp8_rowwise import kernels as fp8_rowwise_kernels

    original = fp8_rowwise_kernels.choose_fp8_rowwise_kernel

    def choose(device, grouped):
        if torch.device(device).type == "cpu":
            return "scaled_mm", "test: torch._scaled_mm on CPU"
        return original(device, grouped)

    monkeypatch.setattr(fp8_rowwise_kernels, "choose_fp8_rowwise_kernel", choose)
    monkeypatch.setattr(fp8_rowwise_kernels, "_choice_on", choose)  # the ops' cached lookup


def _scaled_grouped_mm_standin(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                               use_fast_accum=False):
    """CPU torch._scaled_grouped_mm (2d-3d and 2d-2d forms): the CUDA kernel's layout rules, then exact
    dequantization."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.dim() == 2 and b.dim() in (2, 3)
    assert a.stride(1) == 1 and b.stride(-2) == 1, (a.stride(), b.stride())  # row-major A, column-major B
    assert scale_a.is_contiguous() and scale_b.is_contiguous() and offs.dtype == torch.int32
    assert out_dtype == BF16 and use_fast_accum and bias is None
    if b.dim() == 2:  # wgrad: a [N, P], b [P, K], groups along P; scales per (group, row of a / column of b)
        experts, n, k = offs.shape[0], a.shape[0], b.shape[1]
        assert scale_a.shape == (experts * n,) and scale_b.shape == (experts * k,)
        assert all(int(end) % 16 == 0 for end in offs)  # 16-aligned groups
        group = torch.searchsorted(offs, torch.arange(a.shape[1]), right=True).clamp(max=experts - 1)
        a_deq = a.float() * scale_a.view(experts, n)[group].t()
        b_deq = b.float() * scale_b.view(experts, k)[group]
        return torch._grouped_mm(a_deq.to(BF16), b_deq.to(BF16), offs=offs)
    assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
    out = torch._grouped_mm((a.float() * scale_a[:, None]).to(BF16), (b.float() * scale_b[:, None, :]).to(BF16),
                            offs=offs)
    out[int(offs[-1]):] = float("nan")  # the CUDA kernel leaves these rows unwritten
    return out


@pytest.fixture
def scaled_grouped_mm_on_cpu(scaled_mm_on_cpu):
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_grouped_mm", _scaled_grouped_mm_standin, "CPU")
    yield
    lib._destroy()


# ---------------------------------------------------------------- scripts under examples/


def load_example(name: str):
    """examples/<name>.py as a module (the scripts are not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- a tiny DeepSeek-V3 for the harness tests

# the debug DeepSeek-V3 shrunk for a 2-core CPU: every MXFP8 K/N still a multiple of 32
TINY = {"n_layers": 2, "dim": 128, "inter_dim": 256, "moe_inter_dim": 64, "n_heads": 2, "kv_lora_rank": 64,
        "vocab_size": 512}


class TwoLinears(torch.nn.Module):
    """x -> down(relu(up(x))): `up` is rewritten, `down` (the last linear) is left alone as an output head."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def two_linears_per_kernel(recipe: str, kernels, dim: int, hidden: int):
    """One forward and backward of the same TwoLinears through the moepass backend per `<recipe>.kernel`, caches off:
    ({kernel: (output, up's grad, down's grad)}, {kernel: {"forward"|"backward": compiled ops}})."""
    import moepass

    torch.manual_seed(0)
    model = TwoLinears(dim, hidden).to(BF16)
    x = torch.randn(2, 25, dim).to(BF16)
    results, audits = {}, {}
    for kernel in kernels:
        torch._dynamo.reset()
        m = TwoLinears(dim, hidden).to(BF16)
        m.load_state_dict(model.state_dict())
        options = {"recipe": recipe, f"{recipe}.kernel": kernel}
        with moepass.collecting() as report, torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):
            out = torch.compile(m, backend="moepass", options=options)(x)
            out.float().square().sum().backward()
        results[kernel] = (out.detach(), m.up.weight.grad, m.down.weight.grad)
        audits[kernel] = {c["kind"]: c["ops"] for c in report.compiled}
    return results, audits


def recording_aot_backend(graphs: dict, decompositions: dict, compiles: list | None = None):
    """aot_autograd with `decompositions`, running each graph as traced; keeps each graph's call_function targets
    in graphs["fw"] / graphs["bw"] and appends to `compiles` per forward compiled."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = {n.target for n in gm.graph.nodes if n.op == "call_function"}
            if compiles is not None and kind == "fw":
                compiles.append(1)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"), decompositions=decompositions)
