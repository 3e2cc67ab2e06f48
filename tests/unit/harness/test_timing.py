"""moepass/harness/timing.py: throughput, compile time and speedups from step times."""

import pytest

from moepass.harness import timing


def test_timing_stats_arithmetic():
    s = timing.timing_stats([5.0, 0.2, 0.1, 0.4], warmup=1, tokens_per_step=100, world=2)
    assert s["step_ms_median"] == pytest.approx(200.0)
    assert s["tokens_per_s_median"] == pytest.approx(500.0)
    assert s["tokens_per_s_per_device_median"] == pytest.approx(250.0)
    assert (s["tokens_per_s_min"], s["tokens_per_s_max"]) == (pytest.approx(250.0), pytest.approx(1000.0))
    assert s["compile_s"] == pytest.approx(4.8)


def test_speedups_skip_failed_variants_and_fall_back_to_first_ok():
    entries = [{"name": "eager", "status": "ok", "step_ms_median": 30.0},
               {"name": "all", "status": "failed"},
               {"name": "mxfp8_linear", "status": "ok", "step_ms_median": 10.0}]
    assert timing.add_speedups(entries) == "eager"  # no inductor: the first variant that ran
    assert [e["speedup_vs_baseline"] for e in entries] == [pytest.approx(1.0), None, pytest.approx(3.0)]
