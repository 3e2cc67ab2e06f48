"""examples/bench_ep_dispatch.py end to end on 2 gloo CPU ranks (tiny shapes): the script itself works."""

import json
import math
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.extended  # ~30 s on 2 cores; an example script, its ops are CI-tested in test_ep_ops.py
def test_ep_round_trip_bench_runs_on_cpu_and_writes_json(tmp_path):
    out = tmp_path / "ep.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", port,
           os.path.join(REPO, "examples", "bench_ep_dispatch.py"), "--device", "cpu", "--shapes", "tiny",
           "--tokens", "64", "--iters", "3", "--warmup", "1", "--breakdown", "--profile", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["gpus"] == 2 and result["gpu"] == "cpu" and result["compiled"] is True
    (row,) = result["rows"]
    assert "DeepEP needs CUDA" in row["deepep_unavailable"]  # no DeepEP on CPU: said, not silently skipped
    for path in ("standard", "reference"):
        assert row[f"{path}_fwd_ms"] > 0 and row[f"{path}_fwd_bwd_ms"] > 0
        stages = row[f"{path}_fwd_stage_ms"]
        assert len(stages) >= 4 and all(math.isfinite(v) and v >= 0 for v in stages.values())
        kernels = row[f"{path}_fwd_bwd_top_kernels"]  # on CPU: ops by self CPU time
        assert kernels and all(k["self_us_per_run"] > 0 for k in kernels)
