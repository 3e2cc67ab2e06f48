"""moepass/harness/parity.py: moving averages, loss gaps and the converge verdict, no training."""

import math

import pytest

from moepass.harness import parity


def test_compare_pass_fail_and_failures():
    base = [3.0, 2.5, 2.0, 2.0]
    ok = parity.compare({"inductor": _run(base), "moepass": _run([3.0, 2.5, 2.01, 2.01])}, ["moepass"], 2, 0.01)
    assert ok["pass"] and ok["final_loss_gap_rel"] == pytest.approx(0.005)
    off = parity.compare({"inductor": _run(base), "moepass": _run([3.0, 2.5, 2.1, 2.1])}, ["moepass"], 2, 0.01)
    assert not off["pass"] and off["final_loss_gap_rel"] == pytest.approx(0.05)
    nan = parity.compare({"inductor": _run(base), "moepass": _run([3.0, float("nan"), 2.0, 2.0])},
                         ["moepass"], 4, 0.01)
    assert not nan["pass"] and math.isnan(nan["final_loss_gap_rel"])
    failed = parity.compare({"inductor": _run(base), "moepass": {"status": "failed", "error": "x"}},
                            ["moepass"], 2, 0.01)
    assert not failed["pass"] and failed["final_loss_gap_rel"] is None


def test_moving_average():
    assert parity.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    assert parity.moving_average([5.0, 7.0], 1) == [5.0, 7.0]
    with pytest.raises(ValueError):
        parity.moving_average([1.0], 2)


def test_loss_gaps_find_the_worst_window():
    base = [4.0, 4.0, 2.0, 2.0, 2.0]
    cand = [4.0, 4.4, 2.0, 2.0, 2.02]
    g = parity.loss_gaps(base, cand, window=2)
    # windows: base [4, 3, 2, 2], cand [4.2, 3.2, 2, 2.01]
    assert g["max_window_gap_rel"] == pytest.approx(0.2 / 3) and g["max_window_gap_end_step"] == 3
    assert g["final_loss_gap_rel"] == pytest.approx(0.005)


def _run(loss, val=2.0):
    return {"status": "ok", "loss": list(loss), "val_loss": val}
