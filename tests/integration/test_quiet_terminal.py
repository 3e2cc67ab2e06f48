"""A quiet terminal: a user's script and the CLI print no third-party lines moepass causes, and moepass leaves the
user's logging and warning settings as it found them (torchao's import-time lines are dropped only while moepass
imports torchao)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY
from moepass import torchao_import
from moepass.cli import cpu_speed_note

# what a user writes: nothing but torch, the backend found through its entry point
USER_SCRIPT = """\
import torch
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(torch.bfloat16)
torch.compile(model, backend="moepass")(torch.randn(32, 64, dtype=torch.bfloat16)).sum().backward()
"""

# moepass's import and compile between two readings of every logger's settings and of the warning filters, the first
# taken after a plain Inductor compile (what torch itself sets on a first compile is not moepass's doing)
STATE_SCRIPT = """\
import json, logging, sys, warnings
import torch
torch.compile(torch.nn.Linear(64, 64), backend="inductor")(torch.randn(32, 64)).sum().backward()

def settings():
    loggers = {"": logging.getLogger(), **{name: logging.getLogger(name) for name in
               (*logging.root.manager.loggerDict, "torchao", "torch.utils._pytree", "moepass")}}
    return {"warning_filters": [repr(f) for f in warnings.filters], "disable": logging.root.manager.disable,
            "loggers": {name: [log.level, log.propagate, log.disabled, [repr(h) for h in log.handlers],
                               [repr(f) for f in log.filters]]
                        for name, log in loggers.items() if isinstance(log, logging.Logger)}}

before = settings()
import moepass
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)).to(torch.bfloat16)
torch.compile(model, backend="moepass")(torch.randn(32, 64, dtype=torch.bfloat16)).sum().backward()
after = settings()
assert "torchao" in sys.modules, "the compile never imported torchao"
assert moepass.last_report().to_dict()["passes"], "nothing compiled"
print(json.dumps({"before": before, "after": after}))
"""


def _run(args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parent)


def test_a_users_three_line_script_prints_nothing():
    run = _run([sys.executable, "-c", USER_SCRIPT])
    assert run.returncode == 0, run.stderr[-3000:]
    assert (run.stdout, run.stderr) == ("", "")


def test_import_and_compile_leave_logging_and_warnings_as_they_were():
    run = _run([sys.executable, "-c", STATE_SCRIPT])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr == ""
    state = json.loads(run.stdout)
    before, after = state["before"], state["after"]
    assert after["warning_filters"] == before["warning_filters"]
    assert after["disable"] == before["disable"]
    changed = {name: (was, after["loggers"][name]) for name, was in before["loggers"].items()
               if after["loggers"][name] != was}
    assert changed == {}


def test_cli_prints_no_third_party_lines():
    # the shape tests/unit/harness/test_bench.py trains: Inductor's C++ kernels for it are compiled once per test run
    run = _run([sys.executable, "-m", "moepass.cli", "inspect", "--model-overrides", json.dumps(TINY),
                "--batch", "2", "--seq", "32"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr == ""
    assert "Failed to load" not in run.stdout and "register_constant" not in run.stdout


@pytest.fixture
def torchao_loggers(monkeypatch):
    """{logger name: messages its handler saw}; torchao_import() behaving as before torchao's first import."""
    monkeypatch.setattr(torchao_import, "PRINTS_ON_IMPORT", ("moepass_test.never_imported",))
    seen, added = {}, []
    for name in torchao_import.LOGGERS:
        logger, handler = logging.getLogger(name), logging.Handler()
        handler.emit = lambda record, name=name: seen.setdefault(name, []).append(record.getMessage())
        added.append((logger, handler, logger.level))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        monkeypatch.setattr(logger, "disabled", False)
    yield seen
    for logger, handler, level in added:
        logger.removeHandler(handler)
        logger.setLevel(level)


EXTENSION_LINE = "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
ENUM_LINE = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
             "opaque value type. Calling register_constant() on Enum subclasses is deprecated and will be an error")


def test_known_lines_dropped_inside_only(torchao_loggers):
    torchao, pytree = (logging.getLogger(name) for name in torchao_import.LOGGERS)
    with torchao_import.torchao_import():
        with torchao_import.torchao_import():  # nested: the filter stays until the outer block ends
            torchao.warning(EXTENSION_LINE)
        pytree.warning(ENUM_LINE)
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version")
    torchao.warning(EXTENSION_LINE)
    pytree.warning(ENUM_LINE)
    assert torchao_loggers == {
        "torchao": ["Skipping import of cpp extensions due to incompatible torch version", EXTENSION_LINE],
        "torch.utils._pytree": [ENUM_LINE]}
    assert all(not logging.getLogger(name).filters for name in torchao_import.LOGGERS)


def test_filter_comes_off_when_the_import_fails(torchao_loggers):
    with pytest.raises(ImportError), torchao_import.torchao_import():
        import moepass_test.never_imported  # noqa: F401
    assert all(not logging.getLogger(name).filters for name in torchao_import.LOGGERS)


def test_nothing_to_drop_once_torchao_is_loaded(monkeypatch):
    monkeypatch.setattr(torchao_import, "PRINTS_ON_IMPORT", ("logging",))
    with torchao_import.torchao_import():
        assert all(not logging.getLogger(name).filters for name in torchao_import.LOGGERS)


@pytest.mark.parametrize("inductor_ms, moepass_ms, says", [
    (100.0, 131.0, "moepass ran at 0.76x Inductor's speed in this run."),
    (100.0, 96.0, "moepass ran at 1.04x Inductor's speed in this run, although its emulated GEMMs do more work"),
])
def test_demo_cpu_note_says_what_this_run_measured(inductor_ms, moepass_ms, says):
    note = cpu_speed_note(inductor_ms / 1e3, moepass_ms / 1e3)
    assert says in note
    assert "slower" not in note
