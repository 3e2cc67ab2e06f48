"""After `pip install`, torch.compile(backend="moepass") finds the backend with no `import moepass`."""

import os
import site
import subprocess
import sys
import sysconfig
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    assert "moepass" not in sys.modules
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.Linear(64, 1024)).bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    # Inductor off: the point is the backend found by name (the CI demo compiles with Inductor in a fresh venv)
    out = torch.compile(model, backend="moepass", options={"inductor": False})(x)
    out.float().square().mean().backward()
    opt.step()
    import moepass
    report = moepass.last_report().to_dict()
    linear = [p for p in report["passes"] if p["name"] == "linear"][0]
    print("replaced", linear["replaced"], "skipped", [s["module"] for s in linear["skipped"]])
""")


def test_fresh_venv_install_registers_backend(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    # torch and torchao come from the running environment (a second multi-GB torch is not the point here).
    # `venv --system-site-packages` would inherit the *base* interpreter's packages, which inside a
    # virtualenv lack torch; a .pth naming this environment's site-packages works in and outside one.
    venv_site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    parent_sites = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    with open(os.path.join(venv_site, "parent_env.pth"), "w") as f:
        f.write("\n".join(dict.fromkeys(parent_sites)) + "\n")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", REPO],
                   check=True, timeout=300, cwd=tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([py, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # the two hidden linears become MXFP8; the last (no GEMM or residual after it) is the head
    assert "replaced 2 skipped ['3']" in out.stdout, out.stdout
    assert str(venv) in subprocess.run([py, "-c", "import moepass; print(moepass.__file__)"], capture_output=True,
                                       text=True, cwd=tmp_path, env=env).stdout
