"""A moepass op's outputs are ordinary tensors to the code after it (moepass/ops/fresh_outputs.py): `add_`, `mul_` and
an `add_` through a view of each op family's output (linear, grouped, rows, EP dispatch / combine; every recipe) give
the values and gradients of the same code written out of place. Eagerly, the ops are called under autograd, one change
at a time; compiled through backend="moepass", with and without Inductor, the passes insert them into a tiny module
that changes one output inside the graph and returns another for the caller to change (EP: the module calls the ops as
the deepep pass emits them).

Every reference is the op itself, called eagerly, with the changes written out of place, so values and gradients are
bit-equal where the same code runs (eager ops, and the rewritten graph run eagerly) and within rounding where Inductor
fuses the changes. Cotangents are small integers, so gradients summed through a view are exact in any order.
HF Llama4's MoE (`out.add_(...)` on its shared expert's output) is tests/integration/test_hf_families.py's case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import moepass
import moepass.ops  # noqa: F401  (registers torch.ops.moepass.*)
from helpers import EpProblem, make_rank_inputs
from moepass.ops.ep.dispatch_combine import group_args
from moepass.ops.fresh_outputs import fresh_outputs

BF16 = torch.bfloat16
ops = torch.ops.moepass
RECIPES = ("mxfp8", "fp8_rowwise", "blockwise")
ROWS_RECIPES = ("fp8_rowwise", "blockwise")  # the recipes with a rows form (quantize_once)
FAMILY_RECIPES = [(f, r) for f in ("linear", "grouped") for r in RECIPES] + [("rows", r) for r in ROWS_RECIPES]
OP_ARGS = {"mxfp8": ("rceil", False, "emulated"), "fp8_rowwise": (False, "emulated"),
           "blockwise": (False, "emulated")}  # (*settings, wgrad_bf16, kernel) the backend passes on CPU
D = 128  # K and N: a multiple of every recipe's block (blockwise's 128)
OFFS = (24, 40, 64)  # three experts' token groups over 64 rows
GATHER = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6] * 8) % 16  # 64 expert rows gathered from 16 token rows


# ---------------------------------------------------------------- the changes, in place and out of place

def _add_(y, t):
    return y.add_(t[: y.shape[-1]])


def _mul_(y, t):
    return y.mul_(t[: y.shape[-1]])


def _view_add_(y, t):  # the first half of every row, through a view of the rows as halves
    half = y.shape[-1] // 2
    y.view(*y.shape[:-1], 2, half)[..., 0, :].add_(t[:half])
    return y


def _first_half(y, t):
    half = y.shape[-1] // 2
    return torch.cat([t[:half], t.new_zeros(half)])


CHANGES = {  # name -> (in place, out of place)
    "add_": (_add_, lambda y, t: y + t[: y.shape[-1]]),
    "mul_": (_mul_, lambda y, t: y * t[: y.shape[-1]]),
    "view_add_": (_view_add_, lambda y, t: y + _first_half(y, t)),
}


def change(y, t, names: tuple[str, ...], in_place: bool):
    for name in names:
        y = CHANGES[name][0 if in_place else 1](y, t)
    return y


# ---------------------------------------------------------------- the op families as tiny modules

class Family(torch.nn.Module):
    """forward(x, t) -> (y, z): two calls of one op family; y changed inside by `changes`, z returned unchanged for
    the caller. spelled: the torch code the passes rewrite (F.linear, torch._grouped_mm); else the moepass op itself.
    """

    def __init__(self, recipe: str, spelled: bool, changes: tuple[str, ...], in_place: bool):
        super().__init__()
        self.recipe, self.spelled, self.changes, self.in_place = recipe, spelled, changes, in_place

    def changed(self, y, t):
        return change(y, t, self.changes, self.in_place)


class Linears(Family):
    def __init__(self, *args):
        super().__init__(*args)
        g = torch.Generator().manual_seed(10)
        self.w1 = torch.nn.Parameter((torch.randn(D, D, generator=g) / D**0.5).to(BF16))
        self.w2 = torch.nn.Parameter((torch.randn(D, D, generator=g) / D**0.5).to(BF16))
        self.b2 = torch.nn.Parameter(torch.randn(D, generator=g).to(BF16))

    def linear(self, x, w, b):
        if self.spelled:
            return F.linear(x, w, b)
        return getattr(ops, f"{self.recipe}_linear")(x, w, b, *OP_ARGS[self.recipe])

    def forward(self, x, t):
        y = self.changed(self.linear(x, self.w1, None), t)  # [B, S, N]: the op's output reshaped from [B*S, N]
        return y, self.linear(x, self.w2, self.b2)


class Grouped(Family):
    def __init__(self, *args):
        super().__init__(*args)
        g = torch.Generator().manual_seed(11)
        self.w1, self.w2 = (torch.nn.Parameter((torch.randn(len(OFFS), D, D, generator=g) / D**0.5).to(BF16))
                            for _ in "12")
        self.register_buffer("offs", torch.tensor(OFFS, dtype=torch.int32))

    def grouped(self, x, w):
        w_t = w.transpose(-2, -1)
        if self.spelled:
            return torch._grouped_mm(x, w_t, offs=self.offs)
        return getattr(ops, f"{self.recipe}_grouped_mm")(x, w_t, self.offs, *OP_ARGS[self.recipe])

    def forward(self, x, t):
        return self.changed(self.grouped(x, self.w1), t), self.grouped(x, self.w2)


class Rows(Grouped):
    """Expert rows gathered from token rows: the quantize_once pass quantizes the token rows once, for both GEMMs."""

    def forward(self, x, t):
        rows = x[GATHER]
        if self.spelled:
            return self.changed(self.grouped(rows, self.w1), t), self.grouped(rows, self.w2)
        # as quantize_once emits it: the quantization has no gradient, the GEMM's rows carry it
        q, scale = getattr(ops, f"{self.recipe}_quantize_rows")(x.detach(), "emulated")
        grouped_rows = getattr(ops, f"{self.recipe}_grouped_mm_rows")

        def gemm(w):  # FP8 rows saved for the wgrad (quantize_once.saved_rows="fp8" below)
            return grouped_rows(rows, q[GATHER], scale[GATHER], w.transpose(-2, -1), self.offs, True,
                                *OP_ARGS[self.recipe])

        return self.changed(gemm(self.w1), t), gemm(self.w2)


FAMILIES = {"linear": Linears, "grouped": Grouped, "rows": Rows}
TOKENS = {"linear": (2, 8, D), "grouped": (OFFS[-1], D), "rows": (16, D)}
PASSES = {"linear": ["linear"], "grouped": ["grouped_mm"], "rows": ["grouped_mm", "quantize_once"]}
OPS_AFTER = {"linear": {"linear": 2}, "grouped": {"grouped_mm": 2}, "rows": {"quantize_rows": 1, "grouped_mm_rows": 2}}


# ---------------------------------------------------------------- running a step and comparing

def cotangent(out: torch.Tensor) -> torch.Tensor:
    return torch.randint(-3, 4, out.shape, generator=torch.Generator().manual_seed(out.numel())).float()


def step(model, fn, tensors, caller_changes: tuple[str, ...] = (), in_place: bool = True, consts: tuple = ()):
    """fn(*consts, *leaves) -> outputs, the caller's changes applied to the last output (t is the last leaf); the
    outputs and the gradients of sum(output * integer cotangent) for fresh leaf copies and the model's parameters."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    *outs, last = fn(*consts, *leaves)
    outs = [*outs, change(last, leaves[-1], caller_changes, in_place)]
    sum((o.float() * cotangent(o)).sum() for o in outs).backward()
    grads = [leaf.grad for leaf in leaves] + [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return [o.detach() for o in outs], grads


def assert_same(got, want, exact: bool, what: str):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g is not None and w is not None, f"{what}: tensor {i} has no gradient"
        if exact:
            assert torch.equal(g, w), f"{what}: tensor {i} differs, max |diff| {(g.float() - w.float()).abs().max()}"
        else:  # Inductor fuses the changes in fp32 and rounds once; a wrong gradient is off by O(1)
            error = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert error < 1e-2, f"{what}: tensor {i} off by {error:.2e} (relative)"


def family_inputs(family: str):
    g = torch.Generator().manual_seed(12)
    return torch.randn(TOKENS[family], generator=g).to(BF16), (torch.randn(D, generator=g) + 1.5).to(BF16)


# ---------------------------------------------------------------- eager: the ops under autograd, one change each

@pytest.mark.parametrize("name", list(CHANGES))
@pytest.mark.parametrize("family, recipe", FAMILY_RECIPES)
def test_an_op_output_changed_in_place_gives_the_out_of_place_values_and_gradients(family, recipe, name):
    x, t = family_inputs(family)
    results = {}
    for in_place in (True, False):
        model = FAMILIES[family](recipe, False, (name,), in_place)
        results[in_place] = step(model, model, (x, t), (name,), in_place)
    (outs, grads), (want_outs, want_grads) = results[True], results[False]
    assert_same(outs, want_outs, True, f"{family} {recipe} {name}: values")
    assert_same(grads, want_grads, True, f"{family} {recipe} {name}: gradients")


@pytest.mark.parametrize("recipe", ROWS_RECIPES)
def test_quantized_rows_and_their_scales_may_be_changed_in_place(recipe):
    """quantize_rows' two outputs (no gradient flows back through them; blockwise's rows were a view of its tiles): FP8
    rows written through a view (CPU has no FP8 add_), scales changed in place; the next call gives the same bits."""
    x = torch.randn(16, D, generator=torch.Generator().manual_seed(13)).to(BF16).requires_grad_()
    quantize = getattr(ops, f"{recipe}_quantize_rows")
    want_q, want_scale = (t.detach().clone() for t in quantize(x, "emulated"))
    q, scale = quantize(x, "emulated")
    q.view(-1)[:D].copy_(torch.ones(D))
    scale.add_(1.0).mul_(2.0).view(-1)[:4].add_(1.0)
    assert torch.equal(q.view(-1)[:D].float(), torch.ones(D))
    assert torch.equal(q.view(-1)[D:].view(torch.uint8), want_q.view(-1)[D:].view(torch.uint8))
    assert torch.equal(scale, (want_scale + 1.0) * 2.0 + F.pad(torch.ones(4), (0, scale.numel() - 4)).view_as(scale))
    again_q, again_scale = quantize(x, "emulated")
    assert torch.equal(again_q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(again_scale, want_scale)


def test_fresh_outputs_detaches_views_in_place_and_copies_only_memory_an_input_or_output_holds():
    """The rule every op body returns through: a view of the body's own result keeps its memory (no copy); an output
    on an input's memory or an earlier output's is a copy (torch.library forbids both aliases)."""
    x, result = torch.randn(4, 8), torch.randn(64)
    y = fresh_outputs(result.view(8, 8)[:4], (x,))
    assert not y._is_view() and y.data_ptr() == result.data_ptr() and torch.equal(y, result.view(8, 8)[:4])
    for aliased in (x, x[1:], x.t()):
        out = fresh_outputs(aliased, (x,))
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and torch.equal(out, aliased)
    first, second, (third, fourth) = fresh_outputs((result[:8], result[8:16], [x.view(-1), torch.ones(2)]), ([x],))
    assert first.data_ptr() == result.data_ptr() and not first._is_view()
    assert second.untyped_storage().data_ptr() != result.untyped_storage().data_ptr()  # first took that memory
    assert third.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() and not fourth._is_view()
    assert torch.equal(second, result[8:16]) and torch.equal(third, x.view(-1))


# ---------------------------------------------------------------- compiled: the passes insert the ops

MODES = {"eager graph": {"inductor": False}, "inductor": {}}
# Inductor on CPU takes seconds a compile: CI compiles each family once with it (define_op is one code path for every
# recipe), and every recipe without it
FIRST_RECIPE = {"linear": "mxfp8", "grouped": "mxfp8", "rows": "fp8_rowwise"}
COMPILED = [pytest.param(f, r, mode, marks=pytest.mark.extended if mode == "inductor" and r != FIRST_RECIPE[f] else ())
            for f, r in FAMILY_RECIPES for mode in MODES]


@pytest.mark.parametrize("family, recipe, mode", COMPILED)
def test_compiled_code_changes_a_rewritten_ops_output_in_place(family, recipe, mode):
    x, t = family_inputs(family)
    changes = tuple(CHANGES)
    reference = FAMILIES[family](recipe, False, changes, False)
    want = step(reference, reference, (x, t), changes, in_place=False)

    torch._dynamo.reset()
    model = FAMILIES[family](recipe, True, changes, True)
    options = {**MODES[mode], "recipe": recipe, f"{recipe}.kernel": "emulated", "passes": PASSES[family],
               "lowp.keep_output_head_bf16": False, "quantize_once.saved_rows": "fp8"}
    compiled = torch.compile(model, backend="moepass", options=options, fullgraph=True)
    with moepass.collecting() as report:
        got = step(model, compiled, (x, t), changes)
    assert {op: report.ops_after()[f"moepass.{recipe}_{op}"] for op in OPS_AFTER[family]} == OPS_AFTER[family]
    exact = mode == "eager graph"  # the rewritten graph runs the reference's ops
    assert_same(got[0], want[0], exact, f"{family} {recipe} {mode}: values")
    assert_same(got[1], want[1], exact, f"{family} {recipe} {mode}: gradients")


# ---------------------------------------------------------------- EP dispatch / combine (reference backend, one rank)

@pytest.fixture(scope="module")
def one_rank():
    """The default process group over this process alone (gloo), as (group_size, group_name)."""
    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield group_args()
    dist.destroy_process_group()


PROBLEM = EpProblem(1, topk=4)  # 12 tokens, hidden 16, 8 experts; topk 4: weight rows split into halves too


class Exchange(torch.nn.Module):
    """ep_dispatch, its received rows and weights changed inside, then ep_combine (the deepep pass's code), whose
    output goes to the caller. quantized: ep_dispatch_quantized instead (FP8 rows sent, x not differentiated here),
    its weights changed and its FP8 rows written through a view (its rows carrier holds no data)."""

    def __init__(self, group, changes: tuple[str, ...], in_place: bool, quantized: bool = False):
        super().__init__()
        self.group, self.changes, self.in_place, self.quantized = group, changes, in_place, quantized
        _, self.topk_idx, _ = make_rank_inputs(PROBLEM)[0]

    def forward(self, x, topk_weights, t):
        args = (self.topk_idx, topk_weights, PROBLEM.num_experts, *self.group, "reference")
        if self.quantized:  # x's values are small integers: exact in e4m3 with scale 1
            x_q, scale = x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], 1)
            _, recv_q, recv_scale, _, recv_w, _, handle = ops.ep_dispatch_quantized(x, x_q, scale, *args)
            first_row = torch.ones(1, x.shape[1])  # written over the first received FP8 row (CPU has no FP8 add_)
            if self.in_place:
                recv_q.view(-1)[: x.shape[1]].copy_(first_row.view(-1))
                recv_x = recv_q.float() * recv_scale
            else:
                recv_x = torch.cat([first_row, (recv_q.float() * recv_scale)[1:]])
        else:
            recv_x, _, recv_w, _, handle = ops.ep_dispatch(x, *args)
            recv_x = change(recv_x, t, self.changes, self.in_place)
        recv_w = change(recv_w, t.float(), self.changes, self.in_place)
        rows = recv_x.float() * recv_w.sum(dim=1, keepdim=True)
        return (ops.ep_combine(rows, handle, *self.group, "reference"),)


def ep_inputs():
    x, _, topk_weights = make_rank_inputs(PROBLEM, integer_x=True)[0]
    return x, topk_weights, (torch.randn(PROBLEM.hidden, generator=torch.Generator().manual_seed(14)) + 1.5).to(BF16)


@pytest.mark.parametrize("quantized", [False, True], ids=["ep_dispatch", "ep_dispatch_quantized"])
@pytest.mark.parametrize("name", list(CHANGES))
def test_ep_outputs_changed_in_place_give_the_out_of_place_values_and_gradients(one_rank, name, quantized):
    x, *tensors = ep_inputs()
    leaves, consts = ((x, *tensors), ()) if not quantized else (tensors, (x,))
    results = {}
    for in_place in (True, False):
        model = Exchange(one_rank, (name,), in_place, quantized)
        results[in_place] = step(model, model, leaves, (name,), in_place, consts)
    (outs, grads), (want_outs, want_grads) = results[True], results[False]
    assert_same(outs, want_outs, True, f"ep {name}: values")
    assert_same(grads, want_grads, True, f"ep {name}: gradients")


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_code_changes_ep_outputs_in_place(one_rank, mode):
    changes = tuple(CHANGES)
    reference = Exchange(one_rank, changes, False)
    want = step(reference, reference, ep_inputs(), changes, in_place=False)
    torch._dynamo.reset()
    model = Exchange(one_rank, changes, True)
    compiled = torch.compile(model, backend="moepass", options=MODES[mode], fullgraph=True)
    got = step(model, compiled, ep_inputs(), changes)
    exact = mode == "eager graph"
    assert_same(got[0], want[0], exact, f"ep {mode}: values")
    assert_same(got[1], want[1], exact, f"ep {mode}: gradients")
