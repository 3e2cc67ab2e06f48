"""What a result file records about where it came from: command, commit, hardware, package versions."""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import os
import pathlib
import platform
import shlex
import subprocess
import sys

import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]  # moepass/harness/provenance.py -> the checkout


def package_version(dist_name: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    deep_ep = package_version("deep_ep") or package_version("deep-ep")
    if deep_ep is None:
        try:
            deep_ep = getattr(importlib.import_module("deep_ep"), "__version__", "unknown")
        except Exception:  # noqa: BLE001 - absent or unloadable: report null
            deep_ep = None
    return {"python": platform.python_version(), "torch": torch.__version__, "torchao": package_version("torchao"),
            "deep_ep": deep_ep, "deep_gemm": package_version("deep_gemm"), "moepass": package_version("moepass"),
            "cuda": torch.version.cuda}


def hardware(device: torch.device, world: int) -> dict:
    cpu = platform.processor() or None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    hw = {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(), "device": device.type,
          "world_size": world}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hw.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_bytes=props.total_memory,
                  compute_capability=f"{props.major}.{props.minor}")
    return hw


def git_commit() -> dict:
    """The moepass checkout's commit and whether it has uncommitted changes (nulls outside git).

    MOEPASS_COMMIT names the commit where the tree has no .git (e.g. a copy sent to a GPU machine)."""
    if os.environ.get("MOEPASS_COMMIT"):
        return {"commit": os.environ["MOEPASS_COMMIT"], "dirty": None}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip()) if not dirty.returncode else None}


def provenance(schema: str, device: torch.device, world: int) -> dict:
    git = git_commit()
    return {"schema": schema, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(getattr(sys, "orig_argv", sys.argv)), "commit": git["commit"],
            "commit_dirty": git["dirty"], "hardware": hardware(device, world), "versions": versions()}
