"""Module paths in reports are the full state_dict spelling, also in graphs of frames resumed after a break."""

from __future__ import annotations

import torch
from torch import nn

import moepass
from moepass.analysis.module_paths import normalize_module_path


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
        self.down = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        h = self.gate(x)
        torch._dynamo.graph_break()  # the rest compiles as a frame whose `self` is this block
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _linear_modules(options) -> list[str]:
    torch._dynamo.reset()
    report = moepass.inspect(Model(), torch.randn(2, 64, dtype=torch.bfloat16), options={"inductor": False, **options})
    (linear,) = [p for p in report.to_dict()["passes"] if p["name"] == "linear"]
    assert report.to_dict()["graphs"] >= 2  # the break really split the block
    return sorted(r["module"] for r in linear["rewrites"]), sorted(s["module"] for s in linear["skipped"])


def test_paths_after_a_graph_break_are_full():
    rewritten, skipped = _linear_modules({"lowp.keep_output_head_bf16": False})
    assert rewritten == ["layers.0.down", "layers.0.gate", "layers.1.down", "layers.1.gate"] and skipped == []


def test_globs_written_for_full_paths_match_after_a_graph_break():
    rewritten, skipped = _linear_modules({"lowp.keep_output_head_bf16": False, "lowp.exclude": ["layers.1.*"]})
    assert rewritten == ["layers.0.down", "layers.0.gate"] and skipped == ["layers.1.down", "layers.1.gate"]


def test_recorded_paths_are_normalised_when_no_live_module_is_at_hand():
    raw = "L['self'].__dict__['_modules']['_checkpoint_wrapped_module'].moe.forward.__closure__[0].cell_contents.__self__.gate"
    assert normalize_module_path(raw) == "moe.gate"
    assert normalize_module_path("L['self'].layers[0]._orig_mod.attention.wq") == "layers.0.attention.wq"
