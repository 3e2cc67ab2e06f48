"""moepass in PyTorch's own compile tooling: TORCH_LOGS="+moepass" shows the pass log, and TORCH_TRACE + tlparse
lists each pass's graph before and after it, and the graph's pass report, under Dynamo's compile id."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moepass.report import torch_logs
from moepass.options import Config

# the tiny debug model compiled once, Inductor off: the trace is of moepass's passes, not of Inductor's codegen
DEFAULT_PASSES = Config.from_options(None).pipeline
COMPILE_DEBUG_MODEL = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import TINY
from moepass.models import build_model
torch.manual_seed(0)
model = build_model("debug", **TINY).to(torch.bfloat16)
torch.compile(model, backend="moepass", options={{"inductor": False}})(torch.randint(0, TINY["vocab_size"], (1, 32)))
"""


@pytest.fixture(scope="module")
def traced_compile(tmp_path_factory):
    """(stderr, tlparse's output folder) of one compile run with TORCH_LOGS="+moepass" and TORCH_TRACE set."""
    tlparse = shutil.which("tlparse") or shutil.which("tlparse", path=os.path.dirname(sys.executable))
    if tlparse is None:
        pytest.fail("tlparse is not installed: it is in the test extra (pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("trace")
    env = {**os.environ, "TORCH_LOGS": "+moepass", "TORCH_TRACE": str(root / "trace")}
    run = subprocess.run([sys.executable, "-c", COMPILE_DEBUG_MODEL.format(tests=str(Path(__file__).parents[1] / "fixtures"))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    logs = sorted((root / "trace").glob("*.log"))
    assert len(logs) == 1, logs
    parsed = subprocess.run([tlparse, str(logs[0]), "-o", str(root / "tl_out"), "--no-browser", "--strict"],
                            capture_output=True, text=True, timeout=120)
    assert parsed.returncode == 0, parsed.stderr[-3000:]
    return run.stderr, root / "tl_out"


def test_torch_logs_shows_the_pass_log(traced_compile):
    stderr, _ = traced_compile
    for name in DEFAULT_PASSES:
        # torch's format (level letter, time, pid, path:line] [compile id]) around moepass's own pass line
        line = rf"^I\d{{4}} .*pipeline\.py:\d+\] \[0/0\] moepass pass {name}: replaced \d+"
        assert re.search(line, stderr, re.M), name


def test_tlparse_lists_each_pass_before_and_after_beside_dynamos_graph(traced_compile):
    _, out = traced_compile
    compiles = json.loads((out / "compile_directory.json").read_text())
    [(compile_id, artifacts)] = [(cid, [a["name"] for a in c["artifacts"]]) for cid, c in compiles.items()
                                 if any(a["name"].startswith("moepass_") for a in c["artifacts"])]
    stems = [re.sub(r"_\d+\.\w+$", "", name) for name in artifacts]
    assert "dynamo_output_graph" in stems, (compile_id, stems)
    expected = [f"moepass_{name}_{when}" for name in DEFAULT_PASSES for when in ("before", "after")]
    expected.append("moepass_report")
    assert [s for s in stems if s.startswith("moepass_")] == expected
    assert "moepass_linear_after" in (out / "index.html").read_text()


def test_traced_graphs_and_report_agree(traced_compile):
    _, out = traced_compile
    files = {re.sub(r"_\d+\.\w+$", "", p.name): p for p in out.rglob("moepass_*")}
    report = json.loads(files["moepass_report"].read_text())
    replaced = {p["name"]: p["replaced"] for p in report["passes"]}
    assert replaced["linear"] > 0
    linear_ops = [len(re.findall(r"torch\.ops\.moepass\.\w+_linear\b", files[f"moepass_linear_{w}"].read_text()))
                  for w in ("before", "after")]
    assert linear_ops == [0, replaced["linear"]]
    # each pass starts from the graph the previous one left
    for previous, name in zip(DEFAULT_PASSES, DEFAULT_PASSES[1:]):
        assert files[f"moepass_{name}_before"].read_text() == files[f"moepass_{previous}_after"].read_text()


def test_registered_with_torch_logging_without_touching_the_logger():
    moepass_log = logging.getLogger("moepass")
    state = (moepass_log.level, list(moepass_log.handlers), moepass_log.propagate)
    torch_logs.register()
    assert torch._logging._internal.log_registry.is_log("moepass")
    assert (moepass_log.level, list(moepass_log.handlers), moepass_log.propagate) == state


def test_no_trace_no_payload(monkeypatch):
    # without TORCH_TRACE the payloads (graph code, the report) are never built
    monkeypatch.setattr(torch._logging._internal.trace_log, "handlers", [])
    torch_logs.trace_pass_graph("linear", "after", lambda: pytest.fail("payload built with no trace"))
