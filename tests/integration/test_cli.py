"""The command line as a user runs it: `moepass inspect` and `moepass demo` (small settings), and its usage errors."""

import json
import subprocess
import sys

import pytest

from moepass.cli import main


def _moepass(*args, timeout=900):
    out = subprocess.run([sys.executable, "-m", "moepass.cli", *args], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# ~18 s: CI runs `moepass demo`, which inspects the same model through the CLI and prints this table; report.save's
# files are checked by tests/unit/test_backend_e2e.py::test_report_save_writes_json_code_and_html
@pytest.mark.extended
def test_inspect_prints_table_and_saves_report(tmp_path):
    stdout = _moepass("inspect", "--layers", "2", "--batch", "2", "--seq", "32", "--out", str(tmp_path))
    assert "grouped_mm" in stdout and "router gate" in stdout and "output head" in stdout
    report = json.loads((tmp_path / "report.json").read_text())
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["grouped_mm"]["replaced"] == 3 and report["graph_breaks"] == 0
    assert (tmp_path / "report.html").exists()


@pytest.mark.extended  # ~50 s cold: pytest -m extended; .ci/run runs the README's demo command itself and checks its output
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


# ---------------------------------------------------------------- usage errors: exit 2, the flag named, one line


def _usage_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]  # argparse: usage lines, then the one-line error


@pytest.mark.parametrize("command, flag, value, words", [
    ("demo", "--options", "{bad", ["is not valid JSON", "give a JSON object"]),
    ("inspect", "--options", "[1, 2]", ["is a JSON list, not an object"]),
    ("bench", "--options", "{'single': 'quotes'}", ["is not valid JSON"]),
    ("converge", "--options", "7", ["is a JSON int, not an object"]),
    ("inspect", "--model-overrides", "{dim: 512}", ["is not valid JSON", '{"dim": 512}']),
    ("bench", "--model-overrides", '"dim"', ["is a JSON str, not an object"]),
    ("converge", "--model-overrides", "{", ["is not valid JSON"]),
    ("bench", "--variant", "wgrad={", ["is not valid JSON", "wgrad={"]),
    ("bench", "--variant", '{"mxfp8.wgrad_bf16": true}', ["is not LABEL=JSON"]),
    ("bench", "--variant", "x=[]", ["is a JSON list, not an object"]),
])
def test_bad_json_flag_is_a_usage_error_naming_the_flag(capsys, command, flag, value, words):
    line = _usage_error(capsys, command, flag, value)
    assert line.startswith(f"moepass {command}: error: argument {flag}: ")
    for word in words:
        assert word in line


@pytest.mark.parametrize("command, flag, value, words", [
    ("inspect", "--options", '{"mxfp8.scale_rounding": "nearest"}', ["'rceil', 'floor'"]),
    ("bench", "--options", '{"pases": []}', ["unknown option(s) ['pases']", "did you mean ['passes']"]),
    ("bench", "--variant", 'a={"inductor.options": {"max_autotun": true}}',
     ["'max_autotun'", "torch._inductor.config"]),
])
def test_invalid_options_in_a_flag_are_a_usage_error(capsys, command, flag, value, words):
    line = _usage_error(capsys, command, flag, value)
    assert line.startswith(f"moepass {command}: error: argument {flag}: ")
    for word in words:
        assert word in line


def test_report_dir_under_a_file_is_a_usage_error(capsys, tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    line = _usage_error(capsys, "inspect", "--options", json.dumps({"report_dir": str(a_file / "out")}))
    assert "'report_dir'" in line and "Not a directory" in line


def test_bad_env_options_are_a_usage_error_before_any_model_is_built(capsys, monkeypatch):
    from moepass.harness import flags

    monkeypatch.setattr(flags, "model_spec", lambda args: pytest.fail("a model was built"))
    monkeypatch.setenv("MOEPASS_OPTIONS", "{bad")
    line = _usage_error(capsys, "inspect")
    assert line.startswith("moepass inspect: error: environment variable MOEPASS_OPTIONS='{bad' is not valid JSON")


def test_options_command_prints_the_table_and_the_env_variable(capsys):
    assert main(["options"]) == 0
    out = capsys.readouterr().out
    assert "| `inductor.mode` |" in out and "| `inductor.options` |" in out and "MOEPASS_OPTIONS" in out
