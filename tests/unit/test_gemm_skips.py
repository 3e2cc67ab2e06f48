"""Ineligible GEMMs are left alone with a reason a user can act on; the model still runs correctly."""

import torch
import torch.nn as nn

import moepass
from moepass.report.left_alone import explain, left_alone_table_markdown
from moepass.skips import SkipCode


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
    codes = {s.module: explain(s) for s in _skips(report, "linear") + _skips(report, "grouped_mm")}
    # the batched GEMM is issued by the model itself (no enclosing module): named by its weight, not ''
    assert codes == {"odd_k": SkipCode.NOT_A_MULTIPLE, "fp32": SkipCode.NOT_BF16, "kept": SkipCode.EXCLUDED,
                     "batched": SkipCode.NOT_MOE_FORM}
    for skip in _skips(report, "linear") + _skips(report, "grouped_mm"):
        assert skip.code.phrase in skip.reason, skip  # documented in docs/passes.md's table under its code
    out = torch.compile(model, backend="moepass", options={"lowp.exclude": ["kept"]})(x)
    assert torch.isfinite(out)


def test_include_patterns_limit_the_rewrite():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.Linear(64, 96)).bfloat16()
    report = moepass.inspect(model, torch.randn(8, 64, dtype=torch.bfloat16), options={"lowp.include": ["2"]})
    linear = {p["name"]: p for p in report.to_dict()["passes"]}["linear"]
    assert [r["module"] for r in linear["rewrites"]] == ["2"]
    reasons = {s["module"]: s["reason"] for s in linear["skipped"]}
    assert "matches no lowp.include pattern" in reasons["0"] and "output head" in reasons["3"]


def _generated_table(page: str, marker: str) -> str:
    """The table right after `marker` in docs/`page`."""
    import itertools
    import pathlib

    lines = (pathlib.Path(__file__).parents[2] / "docs" / page).read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if marker in line), len(lines))
    return "\n".join(itertools.takewhile(lambda line: line.startswith("|"), lines[start + 1:]))


def skip_codes_markdown() -> str:
    """docs/troubleshooting.md's lookup of a skip code by the name the report's coverage line gives."""
    rows = ["| code | pass | reason contains | what you can do |", "|---|---|---|---|"]
    rows += [f"| `{c.name}` | {c.passes} | `{c.phrase}` | {c.fix} |" for c in SkipCode]
    return "\n".join(rows)


def test_docs_list_what_moepass_leaves_alone_as_generated():
    assert _generated_table("passes.md", "<!-- left-alone-table") == left_alone_table_markdown(), (
        "docs/passes.md's table is stale: replace it (the lines after its `left-alone-table` marker) with the output "
        "of `python -c 'from moepass.report.left_alone import left_alone_table_markdown as t; print(t())'`")
    assert _generated_table("troubleshooting.md", "<!-- skip-codes-table") == skip_codes_markdown(), (
        "docs/troubleshooting.md's table is stale: replace it (the lines after its `skip-codes-table` marker) with the "
        "output of `python tests/unit/test_gemm_skips.py`")


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
    assert {explain(s) for s in _skips(report, "linear")} == {SkipCode.EMPTY_GEMM}


def _skips(report, pass_name: str) -> list:
    """The pass's skip records over the report's graphs (each with its code, which to_dict leaves out)."""
    return next(p for p in report.pass_totals() if p.name == pass_name).skipped


def test_explain_finds_a_code_by_itself_its_name_or_a_record_carrying_it():
    from moepass.report.records import Skip

    assert explain(SkipCode.ROUTER_GATE) is explain("ROUTER_GATE") is SkipCode.ROUTER_GATE
    assert explain(Skip("n", "m", "router gate: ...", SkipCode.ROUTER_GATE)) is SkipCode.ROUTER_GATE
    assert explain("NO_SUCH_CODE") is None and explain(Skip("n", "m", "no code")) is None
    assert "code" not in Skip("n", "m", "r", SkipCode.ROUTER_GATE).to_dict()  # the report's schema is unchanged


def test_tensor_parallel_layouts_the_ops_do_not_take_are_left_alone_with_their_codes():
    """Under tensor parallelism a GEMM whose DTensor placements no sharding strategy of the ops takes as they are
    stays BF16, with a coded reason (analysis.sharded_gemm), on a fake 2-rank process group."""
    import torch.distributed as dist
    from torch import fx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moepass.analysis.sharded_gemm import sharded_gemm

    assert not dist.is_initialized(), "another test left a process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        tp, dp = (init_device_mesh("cpu", (2,), mesh_dim_names=(name,)) for name in ("tp", "dp"))
        graph = fx.Graph()

        def operands(*values):
            nodes = [graph.placeholder(f"v{len(graph.nodes)}") for _ in values]
            for n, v in zip(nodes, values):
                n.meta["example_value"] = v
            return [*nodes, None]  # no bias

        def dtensor(local, mesh, placement, **shape):
            return DTensor.from_local(local, mesh, [placement], run_check=False, **shape)

        bf16 = torch.bfloat16
        x = dtensor(torch.zeros(4, 64, dtype=bf16), tp, Replicate())
        cases = {  # weight [N, K] -> the code it is left alone with
            "K sharded, x replicated": (dtensor(torch.zeros(64, 32, dtype=bf16), tp, Shard(1)), SkipCode.TP_PLACEMENTS),
            "a plain weight": (torch.zeros(64, 64, dtype=bf16), SkipCode.TP_PLACEMENTS),
            "another mesh": (dtensor(torch.zeros(32, 64, dtype=bf16), dp, Shard(0)), SkipCode.TP_PLACEMENTS),
            "N=65 over 2 ranks": (dtensor(torch.zeros(33, 64, dtype=bf16), tp, Shard(0), shape=torch.Size([65, 64]),
                                          stride=(64, 1)), SkipCode.TP_UNEVEN),
        }
        for case, (weight, code) in cases.items():
            reason = sharded_gemm("linear", operands(x, weight))
            assert explain(reason) is code and code.phrase in reason.text, (case, reason)
        served = dtensor(torch.zeros(32, 64, dtype=bf16), tp, Shard(0))  # colwise: run on the shards
        assert sharded_gemm("linear", operands(x, served)).layout == "colwise over tp (2 ranks)"
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(skip_codes_markdown())
