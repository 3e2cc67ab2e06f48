"""The run's report adds up: torchtitan-style per-block compiles (each block and the loss a torch.compile call of
its own) show every graph in `last_report()` and in `report_dir` (totals, an index, one report per graph), and
the graphs Inductor compiled, the backward included, reach the files on disk."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from helpers import TINY, compile_caches_off
from torch import fx, nn

import moepass
from moepass.inductor_stage.cache_key import CompiledGraphAudit
from moepass.options import DEFAULT_PASSES
from moepass.harness.train import next_token_loss
from moepass.models import build_model

PASSES = ("deepep", "grouped_mm", "linear")


def _read(path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def per_block_run(tmp_path_factory):
    """The debug DeepSeek-V3 with a dense and an MoE block, each block and the loss compiled apart (as
    torchtitan's apply_compile does), one forward and backward; the report_dir read after each. At the harness tests'
    widths (TINY, tokens [2, 32]): Inductor's kernels for them are compiled once per test run."""
    out = tmp_path_factory.mktemp("report")
    options = {"report_dir": str(out)}
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("debug", **TINY)  # n_layers 2: the first dense
    for block in model.layers:
        block.compile(backend="moepass", options=options)
    loss_of = torch.compile(next_token_loss, backend="moepass", options=options)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32))
    # the compiled-graph audit runs only when Inductor really compiles (not on a warm cache hit)
    with compile_caches_off():
        loss = loss_of(model(tokens), tokens)
        after_forward = {"index": _read(out / "index.json"), "report": _read(out / "report.json")}
        loss.backward()
    return out, moepass.last_report(), after_forward


def test_index_totals_are_the_sums_over_the_graphs_own_reports(per_block_run):
    out, _, _ = per_block_run
    index, report = _read(out / "index.json"), _read(out / "report.json")
    graphs = [_read(out / line["files"] / "report.json") for line in index["graphs"]]
    for name in PASSES:
        own = [next(p for p in g["passes"] if p["name"] == name) for g in graphs]
        total = next(p for p in report["passes"] if p["name"] == name)
        assert index["totals"][name]["replaced"] == sum(p["replaced"] for p in own) == total["replaced"]
        assert index["totals"][name]["skipped"] == sum(len(p["skipped"]) for p in own) == len(total["skipped"])
        assert index["totals"][name]["replaced"] == sum(line["replaced"][name] for line in index["graphs"])
    assert report["graphs"] == len(graphs) == 3


def test_coverage_totals_are_the_sums_over_the_graphs_own(per_block_run):
    """Each block compiled apart: the run's coverage adds up the graphs' (GEMMs, outcomes, FLOPs); the loss has none."""
    out, last, _ = per_block_run
    index = _read(out / "index.json")
    own = [line["coverage"] for line in index["graphs"]]
    total = index["coverage"]
    assert total == last.coverage() == _read(out / "report.json")["coverage"]
    for key in ("gemms", "low_precision", "unaccounted", "not_weight"):
        assert total[key] == sum(c[key] for c in own)
    assert total["flops"]["total"] == sum(c["flops"]["total"] for c in own) > 0
    assert [c["gemms"] for c in own][2] == 0 and own[2]["low_precision_flop_share"] is None  # the loss graph
    assert own[1]["bf16"] == {"ROUTER_GATE": 1} and total["bf16"] == {"ROUTER_GATE": 1}
    page = (out / "report.html").read_text()
    assert page.index("class='coverage'") < page.index("<h2")


def test_every_graph_has_its_own_report_and_code_on_disk(per_block_run):
    out, _, _ = per_block_run
    index = _read(out / "index.json")
    assert [line["compile_call"] for line in index["graphs"]] == [0, 1, 2]  # dense block, MoE block, loss
    assert [call["graphs"] for call in index["compile_calls"]] == [[0], [1], [2]]
    for line in index["graphs"]:
        folder = out / line["files"]
        assert _read(folder / "report.json")["graph"] == line
        assert (folder / "report.html").read_text().count("diff before") == 1
        assert (out / f"graph_{line['graph']}_0_before.py").exists()
        assert (out / f"graph_{line['graph']}_{len(DEFAULT_PASSES)}_after_linear.py").exists()
    page = (out / "report.html").read_text()
    assert all(f"href='graphs/{i}/report.html'" in page for i in range(3))
    assert [line["module"] for line in index["graphs"][:2]] == ["layers.0", "layers.1"]
    assert index["graphs"][2]["module"] == "" and index["graphs"][2]["frame"].startswith("next_token_loss (train.py")


def test_moe_blocks_rewrites_are_in_the_totals_and_in_last_report(per_block_run):
    out, last, _ = per_block_run
    index, d = _read(out / "index.json"), last.to_dict()
    moe = next(line for line in index["graphs"] if line["module"] == "layers.1")
    assert moe["replaced"]["grouped_mm"] == 3 and moe["replaced"]["linear"] > 0
    assert index["totals"]["grouped_mm"]["replaced"] == 3  # one MoE layer: its three expert GEMMs
    linear = next(p for p in d["passes"] if p["name"] == "linear")
    assert [s["module"] for s in linear["skipped"]] == ["layers.1.moe.router.gate"]
    assert linear["replaced"] == d["ops_before"]["linear"] - 1 > moe["replaced"]["linear"]  # both blocks' linears
    assert (d["graphs"], d["compile_calls"]) == (3, 3)
    assert json.loads(json.dumps(d, default=str)) == _read(out / "report.json")  # the last save saw it all


def test_compiled_graphs_reach_the_disk_forward_then_backward(per_block_run):
    out, _, after_forward = per_block_run
    assert [line["compiled"] for line in after_forward["index"]["graphs"]] == [["forward"]] * 3
    assert [c["kind"] for c in after_forward["report"]["compiled_graphs"]] == ["forward"] * 3
    index = _read(out / "index.json")
    assert [line["compiled"] for line in index["graphs"]] == [["forward", "backward"]] * 3
    moe_backward = [c["ops"] for c in _read(out / "graphs/1/report.json")["compiled_graphs"] if c["kind"] == "backward"]
    assert moe_backward[0]["moepass.mxfp8_grouped_mm_wgrad"] == 3 and moe_backward[0]["moepass.mxfp8_linear_dgrad"] > 0


def test_summary_has_the_totals_and_a_row_per_graph(per_block_run):
    _, last, _ = per_block_run
    text = last.summary()
    assert text.startswith("moepass: 3 graph(s), 0 graph break(s), 3 torch.compile calls")
    rows = {line.split()[2]: line for line in text.splitlines() if line[:5].strip().isdigit()}
    assert set(rows) == {"layers.0", "layers.1", "next_token_loss"}
    assert "grouped_mm 3" in rows["layers.1"] and rows["layers.1"].endswith("forward+backward")
    assert "grouped_mm" not in rows["layers.0"] and "nothing" in rows["next_token_loss"]


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128, dtype=torch.bfloat16), nn.Linear(128, 64, dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


X = torch.randn(32, 64, dtype=torch.bfloat16)
EAGER = {"inductor": False}


def test_a_call_with_other_options_joins_the_run_with_them(tmp_path):
    torch._dynamo.reset()
    torch.compile(TwoLinears(), backend="moepass", options=EAGER)(X)
    torch.compile(TwoLinears(), backend="moepass", options={**EAGER, "report_dir": str(tmp_path)})(X)
    index = moepass.last_report().index()
    assert [call["graphs"] for call in index["compile_calls"]] == [[0], [1]]
    assert index["compile_calls"][1]["options_differing"] == {"report_dir": str(tmp_path)}
    # the directory one call named holds the run: the graph of the call that named none too
    assert [line["graph"] for line in _read(tmp_path / "index.json")["graphs"]] == [0, 1]
    assert (tmp_path / "graphs/0/report.json").exists() and (tmp_path / "graph_0_0_before.py").exists()


def test_dynamo_reset_ends_the_run_also_for_a_model_compiled_before_an_earlier_reset():
    torch._dynamo.reset()
    compiled = torch.compile(TwoLinears(), backend="moepass", options=EAGER)
    compiled(X)
    torch._dynamo.reset()
    compiled(X)  # compiled again: torch no longer holds this call's backend, so the next reset would skip it
    torch._dynamo.reset()
    assert moepass.last_report() is None
    torch.compile(TwoLinears(), backend="moepass", options=EAGER)(X)
    assert moepass.last_report().to_dict()["graphs"] == 1


def test_a_replayed_graph_keeps_where_it_was_compiled():
    torch._dynamo.reset()
    model = TwoLinears()
    first = moepass.inspect(model, X, options=EAGER)
    again = moepass.inspect(model, X, options=EAGER)  # served from Dynamo's cache: the backend is not called
    (line,) = again.to_dict()["per_graph"]
    assert line["replayed"] and line["compile_id"] == first.to_dict()["per_graph"][0]["compile_id"] != ""
    assert line["frame"].startswith("forward (test_report_index.py")


def test_a_report_that_cannot_be_written_warns_and_the_model_still_compiles(tmp_path, monkeypatch, caplog):
    import moepass.report.files

    def full_disk(path, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(moepass.report.files, "_write", full_disk)
    torch._dynamo.reset()
    model = TwoLinears()
    with caplog.at_level(logging.WARNING, logger="moepass.report.collect"):
        out = torch.compile(model, backend="moepass", options={**EAGER, "report_dir": str(tmp_path)})(X)
    assert out.shape == X.shape and torch.isfinite(out.float()).all()
    assert "could not write the report" in caplog.text and "No space left" in caplog.text
    assert moepass.last_report().to_dict()["graphs"] == 1


def test_a_failing_report_callback_does_not_fail_the_audit(caplog):
    def breaks():
        raise RuntimeError("disk gone")

    audit = CompiledGraphAudit(on_compiled=breaks)
    graph = fx.symbolic_trace(lambda x: torch.ops.aten.mm.default(x, x)).graph
    with caplog.at_level(logging.WARNING, logger="moepass.inductor_stage.cache_key"):
        audit(graph)
    assert audit.sink == [{"kind": "forward", "ops": {"aten.mm": 1}}] and "disk gone" in caplog.text


def test_a_report_saved_where_an_earlier_run_was_replaces_its_graph_files(tmp_path):
    (tmp_path / "graphs/5").mkdir(parents=True)
    (tmp_path / "graphs/5/report.json").write_text("{}")
    (tmp_path / "graph_5_0_before.py").write_text("")
    (tmp_path / "notes.txt").write_text("mine")
    torch._dynamo.reset()
    with moepass.collecting() as report:
        torch.compile(TwoLinears(), backend="moepass", options=EAGER)(X)
    report.save(str(tmp_path))
    names = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")}
    assert "graphs/5" not in names and "graph_5_0_before.py" not in names and "notes.txt" in names
    assert {"graphs/0/report.json", "index.json", "report.json", "report.html"} <= names


def check_each_rank_writes_its_own_report(rank, world_size, directory):
    import torch.nn.functional as F

    torch._dynamo.reset()
    weight = torch.randn(64, 64, dtype=torch.bfloat16)
    fn = torch.compile(lambda x: F.linear(F.linear(x, weight), weight) + x, backend="moepass",
                       options={"report_dir": directory, "inductor": False})
    fn(torch.randn(8, 64, dtype=torch.bfloat16))
    with open(os.path.join(directory, f"rank{rank}", "report.json")) as f:
        saved = json.load(f)
    assert saved["graphs"] == 1, saved


def test_ranks_write_their_reports_apart(tmp_path):
    """Under torch.distributed every rank compiles its own graphs: report_dir/rank<r>/ each, not one overwritten.

    The two ranks take turns in this process on a fake 2-rank group: the directory follows the rank and world size
    torch.distributed reports, and these graphs hold no collective (two spawned ranks cost seconds each)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for rank in range(2):
        assert not dist.is_initialized(), "another test left a process group behind"
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
        try:
            check_each_rank_writes_its_own_report(rank, 2, str(tmp_path))
        finally:
            dist.destroy_process_group()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert _read(tmp_path / "rank0" / "report.json")["graphs"] == 1  # rank 1's report went beside it, not over it
