"""The command line as a user runs it: `moepass inspect` and `moepass demo` (small settings)."""

import json
import subprocess
import sys


def _moepass(*args, timeout=900):
    out = subprocess.run([sys.executable, "-m", "moepass.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_inspect_prints_table_and_saves_report(tmp_path):
    stdout = _moepass("inspect", "--layers", "2", "--batch", "2", "--seq", "32", "--out", str(tmp_path))
    assert "mxfp8_grouped_mm" in stdout and "router gate" in stdout and "output head" in stdout
    report = json.loads((tmp_path / "report.json").read_text())
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["mxfp8_grouped_mm"]["replaced"] == 3 and report["graph_breaks"] == 0
    assert (tmp_path / "report.html").exists()


def test_demo_trains_both_backends_side_by_side():
    stdout = _moepass("demo", "--layers", "2", "--steps", "3", "--batch", "2", "--seq", "32")
    assert "[4/4] training 3 steps with backend='moepass'" in stdout
    assert "step   inductor loss   moepass loss" in stdout
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 5]
    assert len(rows) == 3
    for step, loss_a, loss_b, ms_a, ms_b in rows:
        assert abs(float(loss_a) - float(loss_b)) / float(loss_a) < 0.05  # same init, same data
        assert float(ms_a) > 0 and float(ms_b) > 0
    assert "final loss: inductor" in stdout
