"""Every GEMM a compiled graph holds is accounted for (moepass.report.coverage): rewritten to a low-precision op, kept BF16
with a reason, not a weight GEMM (attention scores), or shown as unaccounted; and the share of GEMM FLOPs that runs
in low precision, in the report's dict, index, files and summary.

Every other test runs under MOEPASS_STRICT_GEMMS (tests/conftest.py): an unaccounted GEMM fails its compile."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY
from torch import nn
from torch.utils.checkpoint import checkpoint

import moepass
from moepass.report import coverage
from moepass.report.coverage import BF16, LOW_PRECISION, NOT_WEIGHT, PASS_OFF, UNACCOUNTED, WGRAD_BF16, census
from moepass.models import build_model

BF = torch.bfloat16
EAGER = {"inductor": False}  # the passes and the report; Inductor adds nothing to either
TOKENS = (2, 16)


def _debug_report(options=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("debug", **TINY)
    tokens = torch.randint(0, TINY["vocab_size"], TOKENS)
    return model, moepass.inspect(model, tokens, options={**EAGER, **(options or {})})


def _uses(report) -> list[dict]:
    return report.to_dict()["gemms"]


def _use(report, module: str) -> dict:
    (found,) = [u for u in _uses(report) if u["module"] == module]
    return found


def test_every_gemm_of_the_debug_model_is_rewritten_or_has_its_reason():
    model, report = _debug_report()
    cov = report.coverage()
    # per layer wq, wkv_a, wkv_b, wo; the dense layer's w1, w3, w2; the MoE layer's experts and shared expert
    assert (cov["gemms"], cov["low_precision"], cov["bf16"], cov["unaccounted"]) == \
        (19, 17, {"OUTPUT_HEAD": 1, "ROUTER_GATE": 1}, 0)
    assert cov["not_weight"] == 2 and {u["op"] for u in _uses(report) if u["status"] == NOT_WEIGHT} == \
        {"scaled_dot_product_attention"}
    assert _use(report, "layers.1.moe.router.gate")["by"] == "linear"
    assert [u["weight"] for u in _uses(report) if u["module"] == "layers.1.moe.experts"] == ["w1", "w3", "w2"]
    # FLOPs: forward, dgrad and wgrad, 3 x 2*M*N*K; a grouped GEMM's M is every routed row (top-2 per token)
    tokens, c = TOKENS[0] * TOKENS[1], model.config
    assert _use(report, "layers.0.attention.wq")["flops"] == 3 * 2 * tokens * c.dim * c.n_heads * c.qk_head_dim
    expert_w1 = next(u for u in _uses(report) if u["module"] == "layers.1.moe.experts")
    assert expert_w1["flops"] == 3 * 2 * tokens * c.n_activated_experts * c.dim * c.moe_inter_dim
    weight = [u for u in _uses(report) if u["status"] != NOT_WEIGHT]
    lowp = sum(u["lowp_flops"] for u in weight)
    assert cov["flops"]["total"] == sum(u["flops"] for u in weight) and cov["flops"]["low_precision"] == lowp
    assert cov["low_precision_flop_share"] == round(lowp / cov["flops"]["total"], 4)
    assert 0.5 < cov["low_precision_flop_share"] < 1  # the BF16 head is a large GEMM at this vocabulary


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_rowwise"])
def test_expert_gemms_on_rows_quantized_once_are_counted_under_every_recipe(recipe):
    """quantize_once turns fp8_rowwise's expert GEMMs into their rows form (x quantized before its gather): those ops
    are low-precision GEMMs of the census like any other moepass GEMM (blockwise's 128 block leaves the tiny model's
    experts BF16: no rows form here)."""
    _, report = _debug_report({"recipe": recipe})
    cov = report.coverage()
    assert (cov["gemms"], cov["low_precision"], cov["unaccounted"]) == (19, 17, 0)
    assert [u["weight"] for u in _uses(report) if u["module"] == "layers.1.moe.experts"] == ["w1", "w3", "w2"]


class Attention(nn.Module):
    """Projections inside an activation-checkpointed body, with attention scores `q @ k.T` between them."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wo = (nn.Linear(64, 64, bias=False, dtype=BF) for _ in range(3))

    def _body(self, x):
        q, k = self.wq(x), self.wk(x)
        scores = torch.softmax(q @ k.transpose(-2, -1), dim=-1)
        return x + self.wo(scores @ k)

    def forward(self, x):
        return checkpoint(self._body, x, use_reentrant=False)


def test_attention_scores_are_not_weight_gemms_and_stay_out_of_the_share():
    torch._dynamo.reset()
    report = moepass.inspect(Attention(), torch.randn(2, 16, 64, dtype=BF), options=EAGER)
    by_status = {}
    for u in _uses(report):
        by_status.setdefault(u["status"], []).append(u)
    assert sorted(u["module"] for u in by_status[LOW_PRECISION]) == ["wk", "wo", "wq"]
    assert [u["op"] for u in by_status[NOT_WEIGHT]] == ["matmul", "matmul"]
    assert all(u["node"].startswith("wrap_body") for u in _uses(report))  # found inside the checkpointed body
    cov = report.coverage()
    assert (cov["gemms"], cov["not_weight"], cov["low_precision_flop_share"]) == (3, 2, 1.0)
    assert cov["flops"]["not_weight"] == sum(u["flops"] for u in by_status[NOT_WEIGHT]) > 0


class Branches(nn.Module):
    """GEMMs inside torch.cond's branches: bodies no pass enters."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64, dtype=BF) * 0.05)
        self.proj = nn.Linear(64, 64, bias=False, dtype=BF)

    def forward(self, x):
        y = torch.cond(x.sum() > 0, lambda t: t @ self.w.t(), lambda t: (t @ self.w.t()) * 2, (x,))
        return x + self.proj(y)


def test_a_gemm_no_pass_accounts_for_is_in_the_report_not_dropped(monkeypatch, tmp_path):
    monkeypatch.delenv(coverage.STRICT_ENV, raising=False)
    torch._dynamo.reset()
    report = moepass.inspect(Branches(), torch.randn(8, 64, dtype=BF), options=EAGER)
    cov = report.coverage()
    assert (cov["gemms"], cov["low_precision"], cov["unaccounted"]) == (3, 1, 2)
    missing = cov["unaccounted_gemms"]
    assert {u["graph"] for u in missing} == {0} and all("cond body" in u["note"] for u in missing)
    assert all(u["op"] == "matmul" and "/" in u["node"] for u in missing)  # `<body>/<node>`: where to look
    assert "UNACCOUNTED (a moepass bug" in report.summary()
    report.save(str(tmp_path))
    assert json.loads((tmp_path / "index.json").read_text())["coverage"]["unaccounted"] == 2
    assert "Unaccounted (a moepass bug" in (tmp_path / "report.html").read_text()


def test_strict_mode_fails_the_compile_that_finds_an_unaccounted_gemm(monkeypatch):
    monkeypatch.setenv(coverage.STRICT_ENV, "1")
    torch._dynamo.reset()
    with pytest.raises(coverage.UnaccountedGemms, match=r"2 GEMM\(s\) on a parameter .*: matmul at .*cond body"):
        torch.compile(Branches(), backend="moepass", options=EAGER)(torch.randn(8, 64, dtype=BF))


def test_the_test_suite_runs_strict():
    """tests/conftest.py turns the check on for every test, and the processes tests start inherit it."""
    assert coverage.strict()


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128, dtype=BF), nn.Linear(128, 64, dtype=BF)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_gemms_of_a_pass_left_out_are_bf16_with_that_reason():
    torch._dynamo.reset()
    report = moepass.inspect(TwoLinears(), torch.randn(32, 64, dtype=BF), options={**EAGER, "passes": ["grouped_mm"]})
    cov = report.coverage()
    assert (cov["gemms"], cov["bf16"], cov["unaccounted"], cov["low_precision_flop_share"]) == (2, {PASS_OFF: 2}, 0, 0)
    assert all("linear pass did not run" in u["note"] for u in _uses(report))


def test_a_bf16_wgrad_is_a_third_of_its_gemms_flops_in_bf16():
    _, report = _debug_report({"mxfp8.wgrad_bf16": True})
    cov = report.coverage()
    lowp = [u for u in _uses(report) if u["status"] == LOW_PRECISION]
    assert lowp and all(u["lowp_flops"] * 3 == u["flops"] * 2 for u in lowp)
    assert cov["flops"]["bf16"][WGRAD_BF16] == sum(u["flops"] // 3 for u in lowp)
    assert cov["low_precision"] == 17  # still low-precision GEMMs: their forward and dgrad are


class Products(nn.Module):
    """One of each GEMM spelling on expert stacks, besides F.linear and the grouped GEMM."""

    def __init__(self, e=4, k=32, n=48, p=16):
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, k, n, dtype=BF))
        self.v = nn.Parameter(torch.randn(e, n, p, dtype=BF))

    def forward(self, y, rows, offs):
        z = torch.einsum("bk,ekn->ebn", y, self.w)
        grouped = torch._grouped_mm(rows, self.w, offs=offs)
        return torch.bmm(z, self.v).sum() + torch.baddbmm(z[..., :16], z, self.v).sum() + grouped.sum()


@pytest.mark.parametrize("dynamic", [False, True])
def test_flops_of_each_gemm_spelling_by_its_sizes_or_their_hints(dynamo_graphs, dynamic):
    e, k, n, p, b, m = 4, 32, 48, 16, 8, 64
    y, rows = torch.randn(b, k, dtype=BF), torch.randn(m, k, dtype=BF)
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    if dynamic:
        for t in (y, rows):
            torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    (gm,) = dynamo_graphs(Products(e, k, n, p), y, rows, offs)
    uses = {u.op: u for u in census(gm, [])}  # no pass ran: every weight GEMM is BF16, its pass off
    assert set(uses) == {"einsum", "_grouped_mm", "bmm", "baddbmm"}
    assert {u.status for u in uses.values()} == {BF16} and {u.code for u in uses.values()} == {PASS_OFF}
    assert uses["einsum"].flops == 3 * 2 * b * k * e * n and uses["einsum"].weight == "w"
    assert uses["_grouped_mm"].flops == 3 * 2 * m * k * n  # M: the rows of every group
    assert uses["bmm"].flops == uses["baddbmm"].flops == 3 * 2 * e * b * n * p
    assert not any(u.estimated for u in uses.values())


def test_the_report_dict_index_files_and_summary_carry_the_same_coverage(tmp_path):
    torch._dynamo.reset()
    compiled = torch.compile(TwoLinears(), backend="moepass", options={**EAGER, "report_dir": str(tmp_path)})
    compiled(torch.randn(32, 64, dtype=BF))
    report = moepass.last_report()
    cov = report.coverage()
    assert (cov["gemms"], cov["low_precision"], cov["low_precision_flop_share"]) == (2, 2, 1.0)
    saved, index = (json.loads((tmp_path / name).read_text()) for name in ("report.json", "index.json"))
    own = json.loads((tmp_path / "graphs/0/report.json").read_text())
    assert saved["coverage"] == index["coverage"] == own["coverage"] == index["graphs"][0]["coverage"] == cov
    assert [u["module"] for u in saved["gemms"]] == ["up", "down"]
    assert [f["outcome"] for f in index["gemms_folded"]] == ["mxfp8 linear"]
    assert f"coverage: {coverage.coverage_line(cov)}" in report.summary()
    assert "100.0%" in (tmp_path / "report.html").read_text()
