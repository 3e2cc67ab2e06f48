"""Every op that reads a weight is accounted for (moepass.analysis.opaque_ops, moepass.report.coverage): an opaque
call (a custom op, an allow_in_graph autograd.Function, a nonstrict_trace function) on a weight of 2 or more dims is
listed with its reason (OPAQUE_WEIGHT_OP), and strict mode fails on one the census cannot list; reads that hold no GEMM
are not listed. A custom op that computes torch._grouped_mm (moepass.analysis.opaque_grouped_mm) is judged by the grouped_mm
pass as one, after a check on sample inputs: rewritten in BF16, or left as it was with a reason naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.analysis import opaque_grouped_mm
from moepass.analysis.gemms import Scopes
from moepass.analysis.opaque_ops import opaque_weight_read
from moepass.report import coverage
from moepass.report.coverage import BF16, LOW_PRECISION, OPAQUE, UNACCOUNTED
from moepass.skips import SkipCode

EAGER = {"inductor": False}


@torch.library.custom_op("weight_ops_test::fused_linear", mutates_args=())
def fused_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@fused_linear.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("weight_ops_test::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale


@scale_rows.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _grouped_loop(x, w, offs, wrong):
    out, start = x.new_zeros(x.shape[0], w.shape[2]), 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[0 if wrong else i]
        start = end
    return out


# a custom grouped GEMM as transformers writes one, and one that is not what its arguments suggest (expert 0 for all)
@torch.library.custom_op("weight_ops_test::grouped_loop", mutates_args=())
def grouped_loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped_loop(x, w, offs, wrong=False)


@torch.library.custom_op("weight_ops_test::not_grouped_mm", mutates_args=())
def not_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _grouped_loop(x, w, offs, wrong=True)


for _op in (grouped_loop, not_grouped_mm):
    _op.register_fake(lambda x, w, offs: x.new_empty(x.shape[0], w.shape[2]))


def _loop_backward(ctx, grad):
    x, w = ctx.saved_tensors
    dx, dw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for i, end in enumerate(ctx.offs.tolist()):
        dx[start:end], dw[i] = grad[start:end] @ w[i].t(), x[start:end].t() @ grad[start:end]
        start = end
    return dx, dw, None


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


for _op in (grouped_loop, not_grouped_mm):
    _op.register_autograd(_loop_backward, setup_context=_save)


class FusedLinearMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


KeptWhole = torch._dynamo.allow_in_graph(FusedLinearMM)  # Dynamo calls it as one opaque node


@torch._dynamo.nonstrict_trace
def untraced_linear(x, w):
    return x @ w.t()


class Opaque(nn.Module):
    """A linear's weight read by an opaque call, spelled `how`."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(64, 64) * 0.1)

    def forward(self, x):
        if self.how == "custom_op":
            return fused_linear(x, self.w)
        if self.how == "autograd_function":
            return KeptWhole.apply(x, self.w.to(x.dtype))  # through a cast: still the weight
        return untraced_linear(x, self.w)


class Elementwise(nn.Module):
    """Parameters read by everything but a GEMM, custom ops on 1-D parameters and on activations included."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.norm = nn.Parameter(torch.ones(64))
        self.bias = nn.Parameter(torch.zeros(64))
        self.expert_bias = nn.Parameter(torch.zeros(4))
        self.table = nn.Parameter(torch.randn(8, 64))  # 2-D, read by torch's own ops only
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = F.rms_norm(h, (64,), self.norm) + self.bias
        h = scale_rows(h, self.norm) + scale_rows(h, h)
        scores = torch.topk(h[..., :4] + self.expert_bias, 2, dim=-1).values.sum()
        return self.proj(h + self.table[ids % 8] * 2).float().square().mean() + scores


def _opaque_reads(dynamo_graphs, model, *args):
    (gm,) = dynamo_graphs(model, *args)
    scopes = Scopes(gm)
    return [r for s in (*scopes.entered, *scopes.unentered) for n in s.graph.nodes
            if (r := opaque_weight_read(n, scopes)) is not None]


@pytest.mark.parametrize("how, op", [
    ("custom_op", "weight_ops_test::fused_linear"),
    ("autograd_function", f"autograd.Function {__name__}.FusedLinearMM"),
    ("nonstrict_trace", f"nonstrict_trace function {__name__}.untraced_linear"),
])
def test_an_opaque_call_on_a_weight_is_found_and_named(dynamo_graphs, how, op):
    torch._dynamo.reset()
    (read,) = _opaque_reads(dynamo_graphs, Opaque(how), torch.randn(8, 64))
    assert (read.op, read.shape) == (op, (64, 64))
    assert read.text() == f"opaque op {op} reads weight w [64, 64]: moepass cannot see its GEMMs"


def test_reads_that_hold_no_gemm_are_not_opaque(dynamo_graphs):
    torch._dynamo.reset()
    assert _opaque_reads(dynamo_graphs, Elementwise(), torch.randint(0, 32, (2, 8))) == []


@pytest.mark.parametrize("how", ["custom_op", "autograd_function", "nonstrict_trace"])
def test_the_census_lists_an_opaque_weight_op_with_its_reason_under_strict_mode(how):
    assert coverage.strict()  # listed with a reason is accounted for: the compile goes on
    torch._dynamo.reset()
    model, x = Opaque(how), torch.randn(8, 64)
    report = moepass.inspect(model, x, options=EAGER)
    cov = report.coverage()
    assert (cov["gemms"], cov["unaccounted"], cov["bf16"]) == (1, 0, {OPAQUE: 1})
    (use,) = report.to_dict()["gemms"]
    assert (use["status"], use["code"], use["weight"]) == (BF16, OPAQUE, "w")
    assert use["note"].startswith(SkipCode.OPAQUE_WEIGHT_OP.phrase) and "reads weight w [64, 64]" in use["note"]
    assert "BF16 (OPAQUE_WEIGHT_OP 1)" in coverage.coverage_line(cov)
    assert torch.equal(torch.compile(model, backend="moepass", options=EAGER)(x), model(x))  # it runs as written


def test_strict_mode_fails_the_compile_on_an_opaque_weight_op_the_census_cannot_list(monkeypatch):
    monkeypatch.setenv(coverage.STRICT_ENV, "1")
    unlisted = coverage._opaque_use

    def cannot_list(*args):  # as a census that finds the op but has no reason for it would
        use = unlisted(*args)
        use.status, use.code = UNACCOUNTED, ""
        return use

    monkeypatch.setattr(coverage, "_opaque_use", cannot_list)
    torch._dynamo.reset()
    said = r"opaque op weight_ops_test::fused_linear reads weight w \[64, 64\]: moepass cannot"
    with pytest.raises(coverage.UnaccountedGemms, match=said):
        torch.compile(Opaque("custom_op"), backend="moepass", options=EAGER)(torch.randn(8, 64))


def test_elementwise_reads_compile_under_strict_mode():
    assert coverage.strict()
    torch._dynamo.reset()
    model = Elementwise()
    ids = torch.randint(0, 32, (2, 8))
    report = moepass.inspect(model, ids, options=EAGER)
    cov = report.coverage()
    assert (cov["gemms"], cov["unaccounted"]) == (1, 0) and "unaccounted_by_code" not in cov  # proj alone
    assert [u["module"] for u in report.to_dict()["gemms"]] == ["proj"]


# ---------------------------------------------------------------- custom ops that compute torch._grouped_mm


class GroupedExperts(nn.Module):
    """x[M, K] @ w[E, K, N] over token groups, through the custom op `op`."""

    def __init__(self, op, dtype, e=4, k=64, n=64):
        super().__init__()
        self.op = op
        self.w = nn.Parameter((torch.randn(e, k, n) * 0.1).to(dtype))

    def forward(self, x, offs):
        return self.op(x, self.w, offs).float().square().mean()


OFFS = torch.tensor([16, 16, 40, 64], dtype=torch.int32)  # an empty group


def _grouped_report(op, dtype, monkeypatch):
    monkeypatch.setitem(opaque_grouped_mm.GROUPED_MM_OPS, "weight_ops_test::grouped_loop", ("x", "w", "offs"))
    monkeypatch.setitem(opaque_grouped_mm.GROUPED_MM_OPS, "weight_ops_test::not_grouped_mm", ("x", "w", "offs"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GroupedExperts(op, dtype)
    x = torch.randn(64, 64, dtype=dtype)
    report = moepass.inspect(model, x, OFFS, options=EAGER)
    (use,) = report.to_dict()["gemms"]
    grouped = next(p for p in report.to_dict()["passes"] if p["name"] == "grouped_mm")
    return model, x, report, use, grouped


def test_a_custom_grouped_gemm_is_checked_on_sample_inputs():
    a, b = torch.ops.weight_ops_test.grouped_loop, torch.ops.weight_ops_test.not_grouped_mm
    for dtype in (torch.float32, torch.bfloat16):
        for order in ((0, 1, 2), (0, 2, 1)):  # w as stored, and transposed (transformers' non-transposed experts)
            assert opaque_grouped_mm.sample_mismatch(a._qualified_op_name, dtype, dtype, torch.int32, order) is None
    why = opaque_grouped_mm.sample_mismatch(b._qualified_op_name, torch.float32, torch.float32, torch.int32, (0, 1, 2))
    assert why.startswith("its output differs from torch._grouped_mm's on sample inputs"), why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_grouped_mm_fallback_computes_torch_grouped_mm(dtype):
    pytest.importorskip("transformers.integrations.moe")  # registers transformers::grouped_mm_fallback
    assert "transformers::grouped_mm_fallback" in opaque_grouped_mm.GROUPED_MM_OPS
    # transformers passes its [E, N, K] experts transposed: (0, 2, 1)
    assert opaque_grouped_mm.sample_mismatch("transformers::grouped_mm_fallback", dtype, dtype, torch.int32,
                                             (0, 2, 1)) is None


def test_a_bf16_custom_grouped_gemm_is_rewritten_as_the_grouped_gemm_it_is(monkeypatch):
    _, _, report, use, grouped = _grouped_report(torch.ops.weight_ops_test.grouped_loop, torch.bfloat16, monkeypatch)
    assert (use["status"], use["by"], use["weight"]) == (LOW_PRECISION, "grouped_mm", "w")
    assert use["flops"] == 3 * 2 * 64 * 64 * 64  # M = every row of the groups
    (rewrite,) = grouped["rewrites"]
    assert rewrite["detail"].endswith("(weight_ops_test::grouped_loop read as torch._grouped_mm)")
    assert report.to_dict()["ops_after"].get("weight_ops_test.grouped_loop", 0) == 0
    assert report.coverage()["unaccounted"] == 0


def test_an_fp32_custom_grouped_gemm_keeps_its_op_and_a_reason_naming_it(monkeypatch):
    model, x, report, use, grouped = _grouped_report(torch.ops.weight_ops_test.grouped_loop, torch.float32,
                                                     monkeypatch)
    (skip,) = grouped["skipped"]
    assert skip["reason"].startswith("weight_ops_test::grouped_loop read as torch._grouped_mm: ")
    assert (use["status"], use["op"], use["by"]) == (BF16, "weight_ops_test.grouped_loop", "grouped_mm")
    assert SkipCode[use["code"]].phrase in skip["reason"] and use["flops"] == 3 * 2 * 64 * 64 * 64
    assert report.to_dict()["ops_after"]["weight_ops_test.grouped_loop"] == 1  # runs as the user wrote it
    assert "_grouped_mm" not in report.to_dict()["ops_after"]
    compiled = torch.compile(model, backend="moepass", options=EAGER)
    assert torch.equal(compiled(x, OFFS), model(x, OFFS))


def test_a_custom_op_that_is_not_the_grouped_gemm_it_looks_like_stays_opaque(monkeypatch):
    monkeypatch.delenv(coverage.STRICT_ENV, raising=False)
    _, _, report, use, grouped = _grouped_report(torch.ops.weight_ops_test.not_grouped_mm, torch.bfloat16,
                                                 monkeypatch)
    assert grouped["rewrites"] == [] and grouped["skipped"] == []
    assert (use["status"], use["code"], use["flops"]) == (BF16, OPAQUE, 0)
    assert "opaque op weight_ops_test::not_grouped_mm reads weight w [4, 64, 64]" in use["note"]
    assert "(not read as torch._grouped_mm: its output differs" in use["note"]
