"""moepass::segment_sum_rows's Triton kernel (ops/rows/triton_segment_sum.py) on CPU, under Triton's interpreter:
the same sums as the op's torch path (index_add in fp32), with rows of no source, negative and int32 indices, several
srcs of mixed dtypes, column blocks that end inside a block, and no rows at all. The interpreter must be on before triton
is imported, so the checks run in a child process (this file run as a script)."""

from __future__ import annotations

import importlib.util

import pytest

CASES = [(50, 37, 90, 1), (64, 300, 20, 2), (7, 5, 30, 3), (0, 8, 4, 1)]  # [M rows, D, n, srcs]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_equals_the_torch_path():
    from helpers import run_under_triton_interpreter  # the child runs this file without tests/ on its path

    run_under_triton_interpreter(__file__, len(CASES))


def _check() -> None:
    import torch

    import moepass.ops  # noqa: F401  (registers moepass::segment_sum_rows)
    from moepass.ops.rows.triton_segment_sum import segment_sum_rows

    gen = torch.Generator().manual_seed(0)
    for m, d, n, count in CASES:
        index = torch.randint(-n, n, (m,), generator=gen, dtype=torch.int32 if count == 2 else torch.int64)
        srcs = [torch.randn(m, d, generator=gen).to(torch.bfloat16 if i % 2 == 0 else torch.float32)
                for i in range(count)]
        want = torch.ops.moepass.segment_sum_rows(srcs, index, n, torch.float32)
        got = segment_sum_rows(srcs, torch.where(index < 0, index + n, index), n, torch.float32, block_d=16)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the same fp32 sums, perhaps in another order
        print("ok", m, d, n, count, flush=True)


if __name__ == "__main__":
    _check()
