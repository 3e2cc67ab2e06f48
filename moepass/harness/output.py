"""What bench and converge print and write: progress lines, one-line errors, the JSON result and its chart."""

from __future__ import annotations

import json
import math
import os


def say(msg: str, rank: int = 0) -> None:
    if rank == 0:
        print(msg, flush=True)


def error_summary(error: str, width: int = 110) -> str:
    """One line of an error: Dynamo's 'backend raised:' header joined to the real exception below it."""
    lines = [ln.strip() for ln in error.splitlines() if ln.strip()]
    text = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
    return text[:width]


def json_safe(x):
    """NaN and infinity (a diverged loss) become null: the file stays valid JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def write_json(result: dict, out_dir: str, stem: str) -> str:
    """Write <out>/<stem>.json (replacing it whole: a reader never sees half a file); its path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(json_safe(result), f, indent=1, allow_nan=False)
    os.replace(path + ".tmp", path)
    return path


def write_outputs(result: dict, out_dir: str, stem: str, plot_fn) -> None:
    """Write <out>/<stem>.json and, when matplotlib is installed, <out>/<stem>.png."""
    path = write_json(result, out_dir, stem)
    say(f"wrote {path}")
    png = os.path.join(out_dir, f"{stem}.png")
    if plot_fn(result, png):
        say(f"wrote {png}")
    else:
        say("PNG skipped: matplotlib is not installed (pip install 'moepass[plot]')")
