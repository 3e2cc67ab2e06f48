"""Every GEMM on a parameter, however spelled, is read as one linear (y = x @ W.T) or listed with its reason.

Finder cases (match records, no compile beyond Dynamo's trace): one small module per spelling, what the record
says. Rewrite cases: the spelling compiled with moepass gives the same bits, forward and both gradients, as the
transposed spelling `F.linear(x, W.t())` compiled with moepass, for MXFP8 (emulated on CPU) and FP8 rowwise
(emulated).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.analysis.gemm_spellings import KN, NK
from moepass.passes.linear import find_linears
from moepass.skips import SkipCode

K, N, E = 64, 96, 4
BF16 = torch.bfloat16


def _param(*shape, seed: int = 0) -> nn.Parameter:
    return nn.Parameter((torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / 8).to(BF16))


class Spelled(nn.Module):
    """One GEMM spelled by `gemm(self, x)`, on a weight of `shape`."""

    def __init__(self, gemm, *shape):
        super().__init__()
        self.weight = _param(*shape)
        self.gemm = gemm

    def forward(self, x):
        return self.gemm(self, x)


def _matches(dynamo_graphs, module, *inputs):
    torch._dynamo.reset()  # one forward, many modules: past Dynamo's recompile limit it would trace none
    (gm,) = dynamo_graphs(module, *inputs)
    return find_linears(gm)


def _x(*shape, seed: int = 1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(BF16)


# ---------------------------------------------------------------- the finder: one record per spelling

LINEAR_SPELLINGS = {
    # name: (gemm, weight shape, x shape, spelling, layout, x_order, n_dim)
    "x @ W": (lambda m, x: x @ m.weight, (K, N), (2, 16, K), "matmul", KN, None, None),
    "torch.matmul(x, W)": (lambda m, x: torch.matmul(x, m.weight), (K, N), (2, 16, K), "matmul", KN, None, None),
    "torch.mm(x, W)": (lambda m, x: torch.mm(x, m.weight), (K, N), (32, K), "mm", KN, None, None),
    "x @ W.t()": (lambda m, x: x @ m.weight.t(), (N, K), (2, 16, K), "matmul", NK, None, None),
    "x @ W.T": (lambda m, x: x @ m.weight.T, (N, K), (2, 16, K), "matmul", NK, None, None),
    "matmul(x, W.transpose(0, 1))": (lambda m, x: torch.matmul(x, m.weight.transpose(0, 1)), (N, K), (2, 16, K),
                                     "matmul", NK, None, None),
    "x @ W.mT": (lambda m, x: x @ m.weight.mT, (N, K), (2, 16, K), "matmul", NK, None, None),
    "x @ W.permute(1, 0)": (lambda m, x: x @ m.weight.permute(1, 0), (N, K), (2, 16, K), "matmul", NK, None, None),
    "torch.mm(x, W.t())": (lambda m, x: torch.mm(x, m.weight.t()), (N, K), (32, K), "mm", NK, None, None),
    "einsum bsd,nd->bsn": (lambda m, x: torch.einsum("bsd,nd->bsn", x, m.weight), (N, K), (2, 16, K), "einsum", NK,
                           None, None),
    "einsum bsd,dn->bsn": (lambda m, x: torch.einsum("bsd,dn->bsn", x, m.weight), (K, N), (2, 16, K), "einsum", KN,
                           None, None),
    "einsum ...d,nd->...n": (lambda m, x: torch.einsum("...d,nd->...n", x, m.weight), (N, K), (2, 16, K), "einsum",
                             NK, None, None),
    "einsum nd,bsd->bsn (weight first)": (lambda m, x: torch.einsum("nd,bsd->bsn", m.weight, x), (N, K), (2, 16, K),
                                          "einsum", NK, None, None),
    "einsum bds,nd->bsn (x permuted)": (lambda m, x: torch.einsum("bds,nd->bsn", x, m.weight), (N, K), (2, K, 16),
                                        "einsum", NK, (0, 2, 1), None),
    "einsum bsd,dn->bns (N in the middle)": (lambda m, x: torch.einsum("bsd,dn->bns", x, m.weight), (K, N),
                                             (2, 16, K), "einsum", KN, None, 1),
}


@pytest.mark.parametrize("name", LINEAR_SPELLINGS)
def test_each_linear_spelling_is_one_match_on_the_parameter(name, dynamo_graphs):
    gemm, w_shape, x_shape, spelling, layout, x_order, n_dim = LINEAR_SPELLINGS[name]
    module = Spelled(gemm, *w_shape)
    (m,) = _matches(dynamo_graphs, module, _x(*x_shape))
    assert (m.spelling, m.layout, m.x_order, m.n_dim, m.problem) == (spelling, layout, x_order, n_dim, None)
    assert m.weight.op == "placeholder" and m.weight.name.endswith("weight_")  # the parameter itself, no view
    assert m.x.op == "placeholder" and m.module == "weight"  # issued by the frame's own module: named by its weight


def test_addmm_on_a_kn_weight_is_a_linear_with_its_bias(dynamo_graphs):
    class AddMM(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Module()
            self.proj.weight, self.proj.bias = _param(K, N), _param(N, seed=2)

        def forward(self, x):
            return torch.addmm(self.proj.bias, x, self.proj.weight)

    (m,) = _matches(dynamo_graphs, AddMM(), _x(32, K))
    assert (m.spelling, m.layout, m.problem) == ("addmm", KN, None)
    assert m.bias.name.endswith("bias_") and m.module == "proj"


class ExpertLoop(nn.Module):
    """torchtune's GroupedExperts off sm_90: per expert, `x_e @ W[e]` on an [E, K, N] stack (or W[e].t() on
    [E, N, K])."""

    def __init__(self, transposed: bool = False):
        super().__init__()
        self.transposed = transposed
        self.w = _param(E, N, K) if transposed else _param(E, K, N)

    def forward(self, x):
        rows = x.chunk(E)
        return torch.cat([r @ (self.w[e].t() if self.transposed else self.w[e]) for e, r in enumerate(rows)])


@pytest.mark.parametrize("transposed, layout", [(False, KN), (True, NK)])
def test_an_expert_stack_indexed_per_expert_is_one_linear_per_expert(transposed, layout, dynamo_graphs):
    matches = _matches(dynamo_graphs, ExpertLoop(transposed), _x(E * 8, K))
    assert len(matches) == E
    assert {(m.layout, m.problem) for m in matches} == {(layout, None)}
    # the weight is the expert's slice W[e] ([K, N] or [N, K]), read from the stack
    assert [tuple(m.weight.meta["example_value"].shape) for m in matches] == [(N, K) if transposed else (K, N)] * E


NOT_LINEAR = {
    # name: (gemm, weight shape, x shape, code)
    "per-head einsum bshd,hdc->bshc (DeepSeek's absorbed wkv_b)": (
        lambda m, x: torch.einsum("bshd,hdc->bshc", x, m.weight), (2, 32, K), (2, 16, 2, 32), SkipCode.BATCHED_GEMM),
    "per-expert einsum ebk,ekn->ebn": (lambda m, x: torch.einsum("ebk,ekn->ebn", x, m.weight), (E, K, N),
                                       (E, 8, K), SkipCode.BATCHED_GEMM),
    "bmm of an expert stack": (lambda m, x: torch.bmm(x, m.weight), (E, K, N), (E, 8, K), SkipCode.BATCHED_GEMM),
    "baddbmm of an expert stack": (lambda m, x: torch.baddbmm(torch.zeros(E, 8, N, dtype=BF16), x, m.weight),
                                   (E, K, N), (E, 8, K), SkipCode.BATCHED_GEMM),
    "matmul of 3-D stacks": (lambda m, x: torch.matmul(x, m.weight), (E, K, N), (E, 8, K), SkipCode.BATCHED_GEMM),
    "W @ x (parameter on the left)": (lambda m, x: m.weight @ x, (N, K), (K, 8), SkipCode.GEMM_FORM),
    "einsum contracting two subscripts": (lambda m, x: torch.einsum("bij,ij->b", x, m.weight), (K, N), (4, K, N),
                                          SkipCode.GEMM_FORM),
    "matrix-vector x @ w": (lambda m, x: x @ m.weight, (K,), (8, K), SkipCode.NOT_2D_WEIGHT),
    "addmm scaled by alpha": (lambda m, x: torch.addmm(m.weight[0], x, m.weight[1:], alpha=0.5), (K + 1, N), (8, K),
                              SkipCode.GEMM_FORM),
    "addmm with a 2-D input": (lambda m, x: torch.addmm(torch.zeros(8, N, dtype=BF16), x, m.weight), (K, N), (8, K),
                               SkipCode.GEMM_FORM),
    # x @ (W @ W) is activation @ activation; the record is W @ W, a product of weights
    "two parameters W @ W": (lambda m, x: x @ (m.weight @ m.weight), (K, K), (8, K), SkipCode.GEMM_FORM),
    "einsum of three operands": (lambda m, x: torch.einsum("bk,kn,n->bn", x, m.weight, torch.ones(N, dtype=BF16)),
                                 (K, N), (8, K), SkipCode.GEMM_FORM),
}


@pytest.mark.parametrize("name", NOT_LINEAR)
def test_a_gemm_on_a_parameter_in_another_form_is_listed_with_its_reason(name, dynamo_graphs):
    gemm, w_shape, x_shape, code = NOT_LINEAR[name]
    (m,) = _matches(dynamo_graphs, Spelled(gemm, *w_shape), _x(*x_shape))
    assert m.problem is not None and m.problem.code is code and code.phrase in m.problem.text
    assert m.role is None


ACTIVATION_GEMMS = {
    "q @ k.T": (lambda q, k: q @ k.transpose(-2, -1), (2, 16, K)),
    "2-D q @ k.t()": (lambda q, k: q @ k.t(), (16, K)),
    "einsum of activations": (lambda q, k: torch.einsum("bsd,btd->bst", q, k), (2, 16, K)),
    "bmm of activations": (lambda q, k: torch.bmm(q, k.transpose(1, 2)), (2, 16, K)),
}


@pytest.mark.parametrize("name", ACTIVATION_GEMMS)
def test_activation_times_activation_is_no_parameter_gemm(name, dynamo_graphs):
    gemm, shape = ACTIVATION_GEMMS[name]
    assert _matches(dynamo_graphs, gemm, _x(*shape), _x(*shape, seed=3)) == []


class Checkpointed(nn.Module):
    """`x @ W` and `x @ W[e]` inside an activation-checkpoint body: their weights reach it as the body's inputs."""

    def __init__(self):
        super().__init__()
        self.up, self.down = _param(K, N), _param(E, N, K)

    def block(self, x):
        return x + torch.relu(x @ self.up) @ self.down[1]

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=False)


def test_gemms_inside_an_activation_checkpoint_body_are_found(dynamo_graphs):
    matches = _matches(dynamo_graphs, Checkpointed(), _x(32, K))
    assert [(m.spelling, m.layout, m.scope.kind, m.problem) for m in matches] == \
        [("matmul", KN, "activation checkpoint", None)] * 2
    assert [m.module for m in matches] == ["up", "down"]  # named by their parameters, through the body's inputs


# ---------------------------------------------------------------- rewritten: the same bits as F.linear(x, W.t())

# each module is one GEMM, which the model returns: its output head by position, rewritten here on request
RECIPES = {
    "mxfp8": {"inductor": False, "lowp.keep_output_head_bf16": False},
    "fp8_rowwise": {"inductor": False, "lowp.keep_output_head_bf16": False, "recipe": "fp8_rowwise",
                    "fp8_rowwise.kernel": "emulated"},
}


def _compiled_step(module, options, *inputs):
    """Output and gradients (inputs, then parameters) of one moepass-compiled step, and the linear pass's record."""
    torch._dynamo.reset()
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    with moepass.collecting() as report:
        out = torch.compile(module, backend="moepass", options=options)(*inputs)
    out.float().square().sum().backward()
    (linear,) = [p for p in report.to_dict()["passes"] if p["name"] == "linear"]
    grads = [t.grad for t in inputs] + [p.grad for p in module.parameters()]
    return out, grads, linear, report.to_dict()["ops_after"]


REWRITTEN = {
    # name: (spelled, transposed spelling on the same weight, weight shape, x shape, GEMMs)
    "x @ W": (lambda m, x: x @ m.weight, lambda m, x: F.linear(x, m.weight.t()), (K, N), (2, 16, K), 1),
    "torch.mm(x, W)": (lambda m, x: torch.mm(x, m.weight), lambda m, x: F.linear(x, m.weight.t()), (K, N), (32, K), 1),
    "addmm(b, x, W)": (lambda m, x: torch.addmm(m.weight[0], x, m.weight[1:]),
                       lambda m, x: F.linear(x, m.weight[1:].t(), m.weight[0]), (K + 1, N), (32, K), 1),
    "x_e @ W[e]": (lambda m, x: torch.cat([r @ m.weight[e] for e, r in enumerate(x.chunk(E))]),
                   lambda m, x: torch.cat([F.linear(r, m.weight[e].t()) for e, r in enumerate(x.chunk(E))]),
                   (E, K, N), (E * 32, K), E),
    "torch.matmul(x, W)": (lambda m, x: torch.matmul(x, m.weight), lambda m, x: F.linear(x, m.weight.t()), (K, N),
                           (2, 16, K), 1),
    "x @ W.t()": (lambda m, x: x @ m.weight.t(), lambda m, x: F.linear(x, m.weight), (N, K), (2, 16, K), 1),
    "x @ W.T": (lambda m, x: x @ m.weight.T, lambda m, x: F.linear(x, m.weight), (N, K), (2, 16, K), 1),
    "x @ W.mT": (lambda m, x: x @ m.weight.mT, lambda m, x: F.linear(x, m.weight), (N, K), (2, 16, K), 1),
    "matmul(x, W.transpose(0, 1))": (lambda m, x: torch.matmul(x, m.weight.transpose(0, 1)),
                                     lambda m, x: F.linear(x, m.weight), (N, K), (2, 16, K), 1),
    "x @ W.permute(1, 0)": (lambda m, x: x @ m.weight.permute(1, 0), lambda m, x: F.linear(x, m.weight), (N, K),
                            (2, 16, K), 1),
    "x_e @ W[e].t()": (lambda m, x: torch.cat([r @ m.weight[e].t() for e, r in enumerate(x.chunk(E))]),
                       lambda m, x: torch.cat([F.linear(r, m.weight[e]) for e, r in enumerate(x.chunk(E))]),
                       (E, N, K), (E * 32, K), E),
    "einsum bsd,nd->bsn": (lambda m, x: torch.einsum("bsd,nd->bsn", x, m.weight), lambda m, x: F.linear(x, m.weight),
                           (N, K), (2, 16, K), 1),
    "einsum bsd,dn->bsn": (lambda m, x: torch.einsum("bsd,dn->bsn", x, m.weight),
                           lambda m, x: F.linear(x, m.weight.t()), (K, N), (2, 16, K), 1),
    "einsum ...d,nd->...n": (lambda m, x: torch.einsum("...d,nd->...n", x, m.weight),
                             lambda m, x: F.linear(x, m.weight), (N, K), (2, 16, K), 1),
    "einsum nd,bsd->bsn (weight first)": (lambda m, x: torch.einsum("nd,bsd->bsn", m.weight, x),
                                          lambda m, x: F.linear(x, m.weight), (N, K), (2, 16, K), 1),
    "einsum bds,dn->bns": (lambda m, x: torch.einsum("bds,dn->bns", x, m.weight),
                           lambda m, x: F.linear(x.permute(0, 2, 1), m.weight.t()).movedim(-1, 1), (K, N),
                           (2, K, 16), 1),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", REWRITTEN)
def test_a_spelling_rewritten_is_bit_equal_to_the_transposed_spelling(name, recipe):
    spelled, transposed, w_shape, x_shape, gemms = REWRITTEN[name]
    x = _x(*x_shape)
    got_out, got_grads, got_linear, ops = _compiled_step(Spelled(spelled, *w_shape), RECIPES[recipe], x)
    want_out, want_grads, want_linear, _ = _compiled_step(Spelled(transposed, *w_shape), RECIPES[recipe], x)
    assert got_linear["replaced"] == want_linear["replaced"] == gemms and got_linear["skipped"] == []
    assert not any(op in ops for op in ("matmul", "mm", "addmm", "einsum")), ops  # no BF16 GEMM left
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads):
        assert torch.equal(got, want)
    bf16 = spelled(Spelled(spelled, *w_shape), x)  # the spelling runs as written without moepass
    assert ((got_out.float() - bf16.float()).norm() / bf16.float().norm()).item() < 0.1  # low precision, same GEMM


def test_gemms_inside_an_activation_checkpoint_body_are_rewritten_there():
    _, grads, linear, ops = _compiled_step(Checkpointed(), RECIPES["mxfp8"], _x(32, K))
    assert linear["replaced"] == 2 and linear["skipped"] == []
    assert all("/" in r["node"] for r in linear["rewrites"])  # recorded as <body>/<node>: rewritten in the body
    assert ops.get("moepass.mxfp8_linear") == 2 and "matmul" not in ops
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)


def test_a_batched_einsum_stays_as_written_with_its_reason():
    module = Spelled(lambda m, x: torch.einsum("bshd,hdc->bshc", x, m.weight), 2, 32, K)
    x = _x(2, 16, 2, 32)
    out, _, linear, ops = _compiled_step(module, RECIPES["mxfp8"], x)
    assert linear["replaced"] == 0 and ops.get("einsum") == 1
    (skip,) = linear["skipped"]
    assert skip["module"] == "weight" and "a batched product per head or expert" in skip["reason"]
    assert torch.equal(out, torch.einsum("bshd,hdc->bshc", x, module.weight))  # BF16, exactly as written


@pytest.fixture
def fake_tp_mesh():
    """A 2-rank tensor-parallel mesh on a fake process group, in this process (collectives do nothing)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_x_at_a_sharded_kn_weight_is_rewritten_per_shard_or_left_with_the_tp_reason(fake_tp_mesh):
    """`x @ W` on a DTensor [K, N] weight: N sharded is colwise once transposed (rewritten on each rank's shard);
    K sharded with a replicated x would need communication the ops do not add (left BF16, with the reason)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    results = {}
    for name, placement in (("N sharded", Shard(1)), ("K sharded", Shard(0))):
        module = Spelled(lambda m, x: x @ m.weight, K, 128)  # N=128: 64 per rank, whole MXFP8 blocks
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), fake_tp_mesh, [placement]))
        x = distribute_tensor(_x(32, K), fake_tp_mesh, [Replicate()])
        results[name] = _compiled_step(module, RECIPES["mxfp8"], x)[2]
    colwise, rowwise = results["N sharded"], results["K sharded"]
    assert colwise["replaced"] == 1 and "per shard (colwise over tp (2 ranks))" in colwise["rewrites"][0]["detail"]
    (skip,) = rowwise["skipped"]
    assert rowwise["replaced"] == 0 and SkipCode.TP_PLACEMENTS.phrase in skip["reason"]
    assert "the weight read transposed" in skip["reason"]
