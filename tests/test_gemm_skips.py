"""Ineligible GEMMs are left alone with a reason a user can act on; the model still runs correctly."""

import torch
import torch.nn as nn

import moepass
from moepass.left_alone import explain, left_alone_table_markdown


class Ineligible(nn.Module):
    def __init__(self):
        super().__init__()
        self.odd_k = nn.Linear(48, 64, bias=False).bfloat16()      # K=48: not a multiple of 32
        self.fp32 = nn.Linear(64, 64, bias=False)                  # float32 weights
        self.kept = nn.Linear(64, 64, bias=False).bfloat16()       # excluded by the user's pattern
        self.ok = nn.Linear(64, 64, bias=False).bfloat16()         # rewritten
        self.batched = nn.Parameter(torch.randn(2, 64, 32, dtype=torch.bfloat16) * 0.1)

    def forward(self, x):
        h = self.odd_k(x)
        h = h + self.fp32(h.float()).to(h.dtype)
        h = h + self.kept(h)
        h = h + self.ok(h)
        b = torch._grouped_mm(h.view(2, -1, 64), self.batched)  # 3-D x 3-D: a batched GEMM, no offsets
        return b.float().square().mean() + h.float().square().mean()  # (a plain .sum() hits a torch 2.13 bug: _grouped_mm backward rejects stride-0 grads)


def test_ineligible_gemms_skipped_with_reasons_and_results_unchanged():
    torch.manual_seed(0)
    model = Ineligible()
    x = torch.randn(2, 16, 48, dtype=torch.bfloat16)
    report = moepass.inspect(model, x, options={"lowp.exclude": ["kept"], "lowp.keep_output_head_bf16": False})
    d = {p["name"]: p for p in report.to_dict()["passes"]}
    linear = {s["module"]: s["reason"] for s in d["linear"]["skipped"]}
    assert "K=48 not a multiple of 32" in linear["odd_k"]
    assert "torch.float32, not bfloat16" in linear["fp32"]
    assert "excluded by lowp.exclude pattern 'kept'" in linear["kept"]
    assert [r["module"] for r in d["linear"]["rewrites"]] == ["ok"]
    (grouped,) = d["grouped_mm"]["skipped"]
    assert "only the MoE form" in grouped["reason"]
    for skip in d["linear"]["skipped"] + d["grouped_mm"]["skipped"]:
        assert explain(skip["reason"]) is not None, skip  # documented in the README's table
    out = torch.compile(model, backend="moepass", options={"lowp.exclude": ["kept"]})(x)
    assert torch.isfinite(out)


def test_include_patterns_limit_the_rewrite():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 96)).bfloat16()
    report = moepass.inspect(model, torch.randn(8, 64, dtype=torch.bfloat16), options={"lowp.include": ["2"]})
    linear = {p["name"]: p for p in report.to_dict()["passes"]}["linear"]
    assert [r["module"] for r in linear["rewrites"]] == ["2"]
    reasons = {s["module"]: s["reason"] for s in linear["skipped"]}
    assert "matches no lowp.include pattern" in reasons["0"] and "output head" in reasons["3"]


def test_readme_lists_what_moepass_leaves_alone_as_generated():
    import pathlib

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    assert left_alone_table_markdown() in readme, "stale: paste moepass.left_alone.left_alone_table_markdown()"


def test_zero_width_gemms_are_left_alone():
    """A zero-width shared expert (N=0, then K=0): 0 is a multiple of 32, but there is nothing to quantize."""

    class ZeroWidth(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 0, bias=False).bfloat16()
            self.down = nn.Linear(0, 64, bias=False).bfloat16()
            self.ok = nn.Linear(64, 64, bias=False).bfloat16()

        def forward(self, x):
            return x + self.down(self.up(x)) + self.ok(x)

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    report = moepass.inspect(ZeroWidth(), x, options={"lowp.keep_output_head_bf16": False, "inductor": False})
    linear = {p["name"]: p for p in report.to_dict()["passes"]}["linear"]
    reasons = {s["module"]: s["reason"] for s in linear["skipped"]}
    assert set(reasons) == {"up", "down"} and all("empty GEMM" in r for r in reasons.values()), reasons
    assert [r["module"] for r in linear["rewrites"]] == ["ok"]
    assert all(explain(r) is not None for r in reasons.values())
