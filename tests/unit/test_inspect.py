"""moepass.inspect and collecting(): the report of what ran, also when Dynamo serves a graph from its cache."""

from __future__ import annotations

import torch
from torch import nn

import moepass


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(64, 128, dtype=torch.bfloat16), nn.Linear(128, 64, dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


X = torch.randn(32, 64, dtype=torch.bfloat16)
OPTIONS = {"inductor": False}


def _linear_pass(report) -> dict:
    return next(p for p in report.to_dict()["passes"] if p["name"] == "linear")


def test_inspect_of_a_model_compiled_before_replays_its_report():
    torch._dynamo.reset()
    model = TwoLinears()
    first = moepass.inspect(model, X, options=OPTIONS)
    again = moepass.inspect(model, X, options=OPTIONS)  # Dynamo's cache hit: the backend is not called
    for report in (first, again):
        assert report.to_dict()["graphs"] == 1 and _linear_pass(report)["replaced"] == 2
    assert first.replayed == 0 and again.replayed == 1
    assert "served from Dynamo's cache" in again.summary()


def test_another_instance_of_a_compiled_class_reports_the_graph_it_runs():
    torch._dynamo.reset()
    torch.compile(TwoLinears(), backend="moepass", options=OPTIONS)(X)
    report = moepass.inspect(TwoLinears(), X, options=OPTIONS)
    assert report.to_dict()["graphs"] == 1 and _linear_pass(report)["replaced"] == 2


def test_each_graph_counts_once_per_report_however_often_it_runs():
    torch._dynamo.reset()
    compiled = torch.compile(TwoLinears(), backend="moepass", options=OPTIONS)
    with moepass.collecting() as report:
        for _ in range(3):
            compiled(X)
    d = report.to_dict()
    assert d["graphs"] == 1 and d["replayed_graphs"] == 0 and _linear_pass(report)["replaced"] == 2


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 64, dtype=torch.bfloat16)

    def forward(self, x):
        return x + self.proj(x)


def test_last_report_holds_every_compile_call_of_the_run_grouped_by_call():
    torch._dynamo.reset()
    torch.compile(TwoLinears(), backend="moepass", options=OPTIONS)(X)
    assert _linear_pass(moepass.last_report())["replaced"] == 2
    torch.compile(OneLinear(), backend="moepass", options=OPTIONS)(X)  # same options, another model
    d = moepass.last_report().to_dict()
    assert d["graphs"] == 2 and d["compile_calls"] == 2 and _linear_pass(moepass.last_report())["replaced"] == 3
    assert [(g["compile_call"], g["replaced"]["linear"]) for g in d["per_graph"]] == [(0, 2), (1, 1)]


def test_last_report_after_dynamo_reset_does_not_count_graphs_twice():
    torch._dynamo.reset()
    compiled = torch.compile(TwoLinears(), backend="moepass", options=OPTIONS)
    compiled(X)
    torch._dynamo.reset()
    assert moepass.last_report() is None  # what it described was compiled away
    compiled(X)  # the same compiled model compiles again
    assert moepass.last_report().to_dict()["graphs"] == 1


class Broken(TwoLinears):
    def forward(self, x):
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()
        return x + self.down(h)


def test_last_report_gathers_every_graph_of_one_compiled_model():
    torch._dynamo.reset()
    torch.compile(Broken(), backend="moepass", options=OPTIONS)(X)
    report = moepass.last_report()
    # `up` ends the first graph at the break, but nothing shows it is the output head: rewritten (issue 42)
    assert report.to_dict()["graphs"] == 2 and _linear_pass(report)["replaced"] == 2
    assert _linear_pass(report)["skipped"] == []


def test_collecting_counts_graph_breaks():
    torch._dynamo.reset()
    with moepass.collecting() as report:
        torch.compile(Broken(), backend="moepass", options=OPTIONS)(X)
    assert report.graph_breaks == 1 and report.frames_eager == 0
    assert "1 graph break(s)" in report.summary() and "fell back to eager" not in report.summary()


def test_graph_breaks_survive_a_clear_of_dynamos_counters():
    """Test suites clear Dynamo's counters (torch's own do): the run and a collecting() block count the breaks
    after the clear instead of going negative or missing them."""
    from torch._dynamo.utils import counters

    def broken_model():  # a fresh forward each time: Dynamo's cache would serve an earlier one without a break
        class Fresh(TwoLinears):
            def forward(self, x):
                h = torch.relu(self.up(x))
                torch._dynamo.graph_break()
                return x + self.down(h)
        return torch.compile(Fresh(), backend="moepass", options=OPTIONS)

    torch._dynamo.reset()
    broken_model()(X)
    assert moepass.last_report().graph_breaks == 1
    with moepass.collecting() as report:
        torch.compile(TwoLinears(), backend="moepass", options=OPTIONS)(X)
        counters.clear()
        broken_model()(X)
    assert (report.graph_breaks, report.frames_eager) == (1, 0)
    counters.clear()
    broken_model()(X)
    # the run: the break before the collecting() block and the one after the last clear (the block's went to it)
    assert moepass.last_report().graph_breaks == 2


def test_a_checkpointed_layer_dynamo_cannot_trace_is_reported():
    """A graph break inside a checkpointed body cannot be split at: no graph, the layer runs eagerly in BF16."""
    class CheckpointedBroken(TwoLinears):
        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)

        def _body(self, x):
            h = torch.relu(self.up(x))
            print("side effect", end="\r")  # Dynamo cannot trace print inside the checkpoint's body
            return x + self.down(h)

    torch._dynamo.reset()
    with moepass.collecting() as report:
        torch.compile(CheckpointedBroken(), backend="moepass", options=OPTIONS)(X)
    assert (report.to_dict()["graphs"], report.graph_breaks) == (0, 1)
    assert report.summary().startswith("moepass: 0 graph(s), 1 graph break(s)")


def test_a_frame_dynamo_gives_up_on_is_reported_as_run_eagerly():
    """An unsupported context manager (activation offloading) skips the whole frame: its GEMMs never reach moepass."""
    class Offloaded(TwoLinears):
        def forward(self, x):
            with torch.autograd.graph.save_on_cpu(pin_memory=False):
                return self.down(torch.relu(self.up(x)))

    torch._dynamo.reset()
    with moepass.collecting() as report:
        torch.compile(Offloaded(), backend="moepass", options=OPTIONS)(X)
    d = report.to_dict()
    assert (d["graphs"], d["graph_breaks"], d["frames_run_eagerly"]) == (0, 1, 1)
    assert "warning: 1 frame(s) fell back to eager" in report.summary()


def test_cli_inspect_prints_the_coverage_it_saves(tmp_path, capsys):
    """`moepass inspect` prints the coverage line and the GEMMs folded by layer, with the numbers index.json has."""
    import json

    from helpers import TINY

    from moepass.cli import main
    from moepass.report.coverage import coverage_line

    torch._dynamo.reset()
    overrides = {k: v for k, v in TINY.items() if k != "n_layers"}
    assert main(["inspect", "--layers", "4", "--model-overrides", json.dumps(overrides), "--batch", "1", "--seq", "16",
                 "--options", json.dumps(OPTIONS), "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    coverage = json.loads((tmp_path / "index.json").read_text())["coverage"]
    assert f"coverage: {coverage_line(coverage)}" in stdout and coverage["unaccounted"] == 0
    assert "layers.1-3.moe.experts: w1, w3, w2 → mxfp8 grouped GEMM (×3)" in stdout
