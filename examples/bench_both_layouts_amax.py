"""The FP8-rowwise both-layouts op (kernels/triton_both_layouts.both_layouts) against an earlier version, on CUDA.

For DeepSeek-V3's linear operands and expert weights it checks both versions' outputs bit for bit, the per-tile amax
against torch's, and times (CUDA events, bench_fp8_gemms.time_ms) both ops, the amax pass at six tiles and the op at
four quantize-pass tiles. The earlier version is a copy of the module at that time with absolute imports, e.g. the
atomics one of 3ab3daa (then fp8_rowwise/triton_kernels.py):

    git show 3ab3daa:moepass/ops/lowp/fp8_rowwise/triton_kernels.py \\
        | sed -e 's/^from \\.\\.formats/from moepass.ops.lowp.formats/' \\
              -e 's/^from \\.quant/from moepass.ops.lowp.fp8_rowwise.quant/' > /tmp/old_triton_kernels.py
    python examples/bench_both_layouts_amax.py /tmp/old_triton_kernels.py --out out/micro_amax.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import sys

import torch

from bench_fp8_gemms import provenance, time_ms

# (operand, E, R, C): linear operands [1, tokens, channels] at the step benchmarks' token counts, expert weights
SHAPES = [("671B wq_b grad", 1, 16384, 24576), ("671B wo input", 1, 16384, 16384),
          ("671B wq_a input", 1, 16384, 7168), ("671B wo grad", 1, 16384, 7168), ("671B wq_a grad", 1, 16384, 1536),
          ("671B shared w1 grad", 1, 16384, 2048), ("671B experts w1 [E,N,K]", 32, 2048, 7168),
          ("671B experts w2", 32, 7168, 2048), ("16B dense w1 grad", 1, 32768, 10944), ("16B wq grad", 1, 32768, 3072)]
AMAX_TILES = [(256, 32, 128), (128, 32, 128), (256, 16, 256), (512, 32, 128), (256, 64, 64), (128, 16, 256)]
QUANTIZE_TILES = [(128, 64), (64, 128), (128, 128), (64, 64)]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_triton_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", help="the earlier triton_kernels.py, with absolute imports")
    p.add_argument("--out", default="micro_amax.json")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_both_layouts_amax: needs a CUDA GPU", file=sys.stderr)
        return 2
    from moepass.ops.lowp.fp8_rowwise.kernels import triton_both_layouts as new

    old = load_old(args.old)
    run = lambda fn: round(time_ms(fn, args.warmup, args.iters), 4)  # noqa: E731
    rows, totals = [], {"old": 0.0, "new": 0.0}
    for name, e, r, c in SHAPES:
        # rows of different magnitudes, so each row's and each column's amax comes from few elements
        t = (torch.randn(e, r, c, device="cuda") * torch.rand(e, r, 1, device="cuda")).to(torch.bfloat16)
        exact = all(torch.equal(x.float(), y.float()) for x, y in zip(old.both_layouts(t), new.both_layouts(t)))
        row_amax, col_amax = new.tile_amax(t)
        amax_exact = torch.equal(row_amax, t.abs().amax(-1).float()) and torch.equal(col_amax, t.abs().amax(-2).float())
        row = {"operand": name, "shape": [e, r, c], "bit_exact": exact, "amax_exact": amax_exact,
               "old_ms": run(lambda: old.both_layouts(t)), "new_ms": run(lambda: new.both_layouts(t)),
               "amax_tiles_ms": {f"{tr}x{lr}x{tc}": run(lambda: new.tile_amax(t, tr, lr, tc))
                                 for tr, lr, tc in AMAX_TILES},
               "both_tiles_ms": {f"{br}x{bc}": run(lambda: new.both_layouts(t, br, bc)) for br, bc in QUANTIZE_TILES}}
        row["new_GBps_6B"] = round(6 * t.numel() / row["new_ms"] / 1e6, 1)
        if name.startswith("671B"):
            totals["old"] += row["old_ms"]
            totals["new"] += row["new_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"671B operands summed: old {totals['old']:.3f} ms, new {totals['new']:.3f} ms")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**provenance(torch.cuda.get_device_capability()), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
