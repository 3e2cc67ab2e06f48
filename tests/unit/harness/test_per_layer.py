"""examples/per_layer.py: per-MoE-layer time, speedup and peak from two bench.json depths (synthetic here)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
import per_layer  # noqa: E402

GIB = 2**30


def bench(layers, steps_ms, peaks_gib, dense=1, batch=4, failed=()):
    """A bench.json as `moepass bench` writes it: variant -> median step ms, and its peak in GiB."""
    return {"schema": "moepass.bench/1", "commit": "abc", "baseline": "inductor",
            "config": {"model": {"flavor": "671B", "overrides": {"n_dense_layers": dense, "n_layers": layers}},
                       "batch": batch, "seq": 4096, "device": "cuda"},
            "variants": [{"name": n, "status": "error" if n in failed else "ok", "step_ms_median": ms,
                          "peak_mem_bytes": peaks_gib[n] * GIB} for n, ms in steps_ms.items()]}


PEAKS = {"inductor": 100, "all": 80, "peer": 110}


def test_per_layer_is_the_difference_of_depths_and_the_peer_ratio():
    deep = bench(5, {"inductor": 800.0, "all": 650.0, "peer": 740.0}, PEAKS)
    shallow = bench(2, {"inductor": 400.0, "all": 350.0, "peer": 380.0}, PEAKS)
    r = per_layer.per_layer(deep, shallow, peer="peer")["variants"]
    assert r["inductor"]["layer_ms"] == pytest.approx(400 / 3)
    assert r["all"]["layer_ms"] == pytest.approx(100.0)
    assert r["all"]["speedup"] == pytest.approx(4 / 3)
    assert r["peer"]["speedup"] == pytest.approx(400 / 360)
    assert r["all"]["speedup_vs_peer"] == pytest.approx((4 / 3) / (400 / 360))
    assert r["all"]["peak_vs_baseline"] == pytest.approx(0.8)
    assert "/ peer" in per_layer.table(per_layer.per_layer(deep, shallow, peer="peer"))


def test_a_variant_missing_from_either_run_is_left_out():
    deep = bench(5, {"inductor": 800.0, "all": 650.0, "peer": 740.0}, PEAKS, failed=("peer",))
    shallow = bench(2, {"inductor": 400.0, "all": 350.0, "peer": 380.0}, PEAKS)
    assert set(per_layer.per_layer(deep, shallow)["variants"]) == {"inductor", "all"}
    with pytest.raises(SystemExit, match="peer 'peer' did not finish"):
        per_layer.per_layer(deep, shallow, peer="peer")


@pytest.mark.parametrize("deep_kw, shallow_kw, problem", [
    ({"batch": 8}, {}, "differ in more than their depth"),
    ({}, {"layers": 5}, "deeper run first"),
    ({"dense": 3}, {"dense": 3}, "n_dense_layers=3 exceeds"),
])
def test_runs_that_do_not_isolate_moe_layers_are_refused(deep_kw, shallow_kw, problem):
    steps = {"inductor": 800.0, "all": 650.0}
    deep = bench(deep_kw.pop("layers", 5), steps, PEAKS, **deep_kw)
    shallow = bench(shallow_kw.pop("layers", 2), steps, PEAKS, **shallow_kw)
    with pytest.raises(SystemExit, match=problem):
        per_layer.per_layer(deep, shallow)


def test_a_run_without_its_depth_is_refused():
    shallow = bench(2, {"inductor": 400.0}, PEAKS)
    deep = bench(5, {"inductor": 800.0}, PEAKS)
    del deep["config"]["model"]["overrides"]["n_layers"]
    with pytest.raises(SystemExit, match="no n_layers; run `moepass bench` with --layers"):
        per_layer.per_layer(deep, shallow)


def test_cli_writes_the_json(tmp_path, capsys):
    paths = []
    for layers, ms in ((5, 800.0), (2, 400.0)):
        p = tmp_path / f"l{layers}.json"
        p.write_text(json.dumps(bench(layers, {"inductor": ms, "all": ms * 0.8}, PEAKS)))
        paths.append(str(p))
    out = tmp_path / "per_layer.json"
    assert per_layer.main([*paths, "--out", str(out)]) == 0
    assert json.loads(out.read_text())["variants"]["all"]["speedup"] == pytest.approx(1.25)
    assert "ms per MoE layer" in capsys.readouterr().out


def test_what_one_more_layer_keeps_for_the_backward_is_the_difference_of_depths():
    deep = bench(5, {"inductor": 800.0, "all": 650.0}, PEAKS)
    shallow = bench(2, {"inductor": 400.0, "all": 350.0}, PEAKS)
    for run, kept in ((deep, {"inductor": 40, "all": 31}), (shallow, {"inductor": 16, "all": 13})):
        for v in run["variants"]:
            v["kept_for_backward_bytes"] = kept[v["name"]] * GIB
    r = per_layer.per_layer(deep, shallow)["variants"]
    assert r["inductor"]["kept_gib_per_layer"] == pytest.approx(8.0)
    assert r["all"]["kept_gib_per_layer"] == pytest.approx(6.0)
    assert "kept for the backward 6.00 GiB per layer" in per_layer.table(per_layer.per_layer(deep, shallow))
    del deep["variants"][1]["kept_for_backward_bytes"]  # recorded in one run only (a CPU run): left out
    assert "kept_gib_per_layer" not in per_layer.per_layer(deep, shallow)["variants"]["all"]
