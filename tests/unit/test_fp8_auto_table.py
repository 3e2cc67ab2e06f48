"""moepass/recipes/auto_table.py: the measured per-GEMM, per-token-count table behind recipe="auto" on Hopper."""

import json

import pytest

from moepass.recipes import auto_table
from moepass.recipes.auto_table import MIN_SPEEDUP, AutoTable


def table(linear=(), grouped=()) -> AutoTable:
    return AutoTable({"schema": auto_table.SCHEMA, "gpu": "Test GPU", "capability": [9, 0],
                      "linear": [{"K": k, "N": n, "tokens": t, "speedup": s} for k, n, t, s in linear],
                      "grouped": [{"dim": d, "inter": i, "tokens_per_expert": t, "speedup": s}
                                  for d, i, t, s in grouped]}, "test table")


def test_speedup_is_interpolated_in_log_tokens_between_the_measured_counts():
    t = table(linear=[(64, 32, 8192, 1.2), (64, 32, 2048, 0.8)])  # rows in any order
    assert t.linear(64, 32, 2048).speedup == 0.8 and "measured 0.80x at M=2048" in t.linear(64, 32, 2048).detail
    mid = t.linear(64, 32, 4096)  # halfway in log2: 2048 -> 4096 -> 8192
    assert mid.speedup == pytest.approx(1.0) and "interpolated" in mid.detail
    assert not mid.fp8 and t.linear(64, 32, 8192).fp8


def test_outside_the_measured_counts_below_is_bf16_and_above_takes_the_largest():
    t = table(linear=[(64, 32, 2048, 1.5), (64, 32, 8192, 1.2)])
    below = t.linear(64, 32, 1024)
    assert below.speedup is None and not below.fp8 and "below the smallest measured (2048" in below.detail
    above = t.linear(64, 32, 65536)
    assert above.speedup == 1.2 and above.fp8 and "largest M measured (8192)" in above.detail


def test_shapes_the_table_does_not_hold_are_none():
    t = table(linear=[(64, 32, 2048, 1.5)], grouped=[(64, 32, 512, 1.5)])
    assert t.linear(32, 64, 2048) is None and t.grouped(64, 48, 512) is None


def test_an_expert_mlp_row_decides_w1_w3_their_fused_form_and_w2():
    t = table(grouped=[(7168, 2048, 1024, 0.9), (7168, 2048, 2048, 1.05)])
    for k, n in ((7168, 2048), (7168, 4096), (2048, 7168)):
        assert t.grouped(k, n, 2048).fp8 and not t.grouped(k, n, 1024).fp8
        assert "expert MLP dim=7168 inter=2048" in t.grouped(k, n, 2048).detail


def test_the_margin_fp8_needs():
    t = table(linear=[(64, 32, 2048, MIN_SPEEDUP - 1e-3), (64, 32, 4096, MIN_SPEEDUP)])
    assert not t.linear(64, 32, 2048).fp8 and t.linear(64, 32, 4096).fp8


def test_a_table_of_another_schema_is_refused_saying_how_to_re_derive_it():
    with pytest.raises(ValueError, match="--auto-table"):
        AutoTable({"schema": "moepass.fp8_auto_table/0", "linear": [], "grouped": []}, "old.json")


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_each_shipped_table_loads_and_answers_each_row_with_its_own_measurement(gpu):
    shipped = auto_table.for_gpu(gpu)
    assert shipped is not None and shipped.capability == (9, 0) and shipped.gpu == gpu
    data = json.loads((auto_table.SHIPPED_DIR / shipped.source.rsplit("/", 1)[1]).read_text())
    assert data["linear"] and data["grouped"] and data["commit"] and "--auto-table" in data["command"]
    for r in data["linear"]:
        assert shipped.linear(r["K"], r["N"], r["tokens"]).speedup == r["speedup"]
        assert r["speedup"] == pytest.approx(r["bf16_ms"] / r["fp8_ms"], rel=2e-3)
    for r in data["grouped"]:
        assert shipped.grouped(r["dim"], r["inter"], r["tokens_per_expert"]).speedup == r["speedup"]


def test_the_h200_table_is_the_one_the_size_rule_was_read_off():
    assert auto_table.shipped() is auto_table.for_gpu("NVIDIA H200") and auto_table.SHIPPED.name in \
        auto_table.shipped().source


def _gpu(monkeypatch, name: str, capability=(9, 0)):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_a_table_decides_only_on_the_gpu_model_it_was_measured_on(monkeypatch):
    from moepass.recipes import auto

    # 16B attention.wq at 32,768 tokens: 1.07x on the H200, 1.017x on the H100 (under the 1.03x margin)
    _gpu(monkeypatch, "NVIDIA H200")
    recipe, reason = auto.choose_recipe("cuda", "linear", 32768, 2048, 3072)
    assert recipe == "fp8_rowwise" and "decided by the shipped table moepass/recipes/fp8_auto_table_h200.json" in reason
    _gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    recipe, reason = auto.choose_recipe("cuda", "linear", 32768, 2048, 3072)
    assert recipe == "bf16" and "1.02x" in reason and "fp8_auto_table_h100.json" in reason, reason
    _gpu(monkeypatch, "NVIDIA H800")  # same capability, no table: the size rule (measuring is off here)
    recipe, reason = auto.choose_recipe("cuda", "linear", 32768, 2048, 3072)
    assert "decided by the size rule" in reason and "fp8_auto_table" not in reason.split("thresholds")[0]
    _gpu(monkeypatch, "NVIDIA L40S", capability=(8, 9))  # sm_89: no table, the size rule
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 4096, 4096)
    assert recipe == "fp8_rowwise" and auto.THRESHOLDS_SOURCE in reason and "size rule" in reason
