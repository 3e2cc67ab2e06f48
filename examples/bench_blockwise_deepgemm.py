"""Blockwise kernel "deepgemm" op by op at DeepSeek-V3's expert dims: whether each grouped GEMM (forward, dgrad, wgrad
through moepass.ops.lowp.blockwise.kernels.deepgemm = torchao 0.18's token-group padding and quantizers + DeepGEMM)
runs, and its time against BF16 torch._grouped_mm on the same operands. Needs a CUDA GPU and deep_gemm installed
(README).

    python examples/bench_blockwise_deepgemm.py out.json

Each op: one warm-up call (its seconds are first_call_s: DeepGEMM compiles its kernels on first use), then the median
of five calls timed with CUDA events (bench_fp8_gemms.time_ms; the run recorded in examples/results/
blockwise_deepgemm_h200/ took the mean of the five). A failing op is recorded with its error and the run goes on.
"""

import json
import sys
import time
import traceback

import torch
from bench_fp8_gemms import routed_group_sizes, time_ms  # this script's folder is on sys.path when run as a script

from moepass.ops.lowp.blockwise.kernels import deepgemm

# (name, experts, rows, K, N) of the routed experts' GEMMs: the bench's 671B dims (32 experts; 131,072 rows = the
# per-layer step's 16,384 tokens x top-8, where kernel "deepgemm" failed; 65,536 rows ran) and the 16B flavor
GEMMS = [("671B w1 step rows", 32, 131072, 7168, 2048), ("671B w2 step rows", 32, 131072, 2048, 7168),
         ("671B w1", 32, 65536, 7168, 2048), ("671B w2", 32, 65536, 2048, 7168),
         ("671B w1 small M", 32, 4096, 7168, 2048), ("16B w1", 64, 196608, 2048, 1408)]


def group_ends(experts: int, rows: int, seed: int = 0) -> torch.Tensor:
    """Uneven token groups as a softmax router gives them (bench_fp8_gemms's), as cumulative ends on the GPU."""
    return torch.tensor(routed_group_sizes(experts, rows, seed)).cumsum(0).to("cuda", torch.int32)


def measure(name: str, experts: int, rows: int, k: int, n: int) -> list[dict]:
    offs = group_ends(experts, rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w_t = (torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).transpose(-2, -1)
    g = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    bf16 = {"fwd": lambda: torch._grouped_mm(x, w_t, offs=offs),
            "dgrad": lambda: torch._grouped_mm(g, w_t.transpose(-2, -1), offs=offs),
            "wgrad": lambda: torch._grouped_mm(x.t(), g, offs=offs)}
    on_deepgemm = {"fwd": lambda: deepgemm.forward(x, w_t, offs), "dgrad": lambda: deepgemm.dgrad(g, w_t, offs),
                   "wgrad": lambda: deepgemm.wgrad(g, x, offs)}
    rows_out = []
    for op in ("fwd", "dgrad", "wgrad"):
        row = {"gemm": name, "E": experts, "M": rows, "K": k, "N": n, "op": op}
        row["bf16_ms"] = round(time_ms(bf16[op], 1, 5), 3)
        began = time.time()
        try:
            on_deepgemm[op]()
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.time() - began, 1)
            row["deepgemm_ms"] = round(time_ms(on_deepgemm[op], 0, 5), 3)
        except Exception as e:  # noqa: BLE001  (a failing op is a finding: record it and go on)
            row["deepgemm_error"] = f"{type(e).__name__}: {e}"[:300]
            row["where"] = traceback.format_exc().strip().splitlines()[-6:-1]
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    return rows_out


def main() -> None:
    rows = [row for gemm in GEMMS for row in measure(*gemm)]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
