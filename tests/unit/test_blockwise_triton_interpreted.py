"""moepass's Triton blockwise grouped kernels (ops/lowp/blockwise/kernels/triton_grouped.py) on CPU, under Triton's
interpreter, at every autotuning config: the program-to-(group, row tile) mapping, empty groups, groups that end inside
a row tile, rows after the last group, against the emulated GEMM. The interpreter must be on before triton is imported,
so the checks run in a child process (this file run as a script). Their speed and tensor-core numerics are checked on
the GPU (tests/gpu/test_blockwise_gpu.py)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

CLOSE_TO_EMULATED_DB = 40.0  # as tests/gpu/test_blockwise_gpu.py: the same quantized operands


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_grouped_kernels_match_the_emulated_gemm_at_every_config():
    from helpers import run_under_triton_interpreter  # the child runs this file without tests/ on its path

    run_under_triton_interpreter(__file__, 2 * 2 * 4, timeout=600)  # 2 forms x 2 cases x 4 configs


def _check() -> None:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures"))
    from helpers import sqnr
    from moepass.ops.lowp.blockwise import quant
    from moepass.ops.lowp.blockwise.kernels import gemm, triton_grouped

    bf16, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    cases = []
    for sizes, trailing in (([70, 0, 130, 33], 5), ([0, 0], 3)):  # the second: no rows in any group, all trailing
        x = torch.randn(sum(sizes) + trailing, 256, generator=gen).to(bf16)
        w = torch.randn(len(sizes), 384, 256, generator=gen).to(bf16)
        ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
        cases.append(("M-grouped", sizes, (*quant.quantize_tiles(x), *quant.quantize_blocks(w), ends)))
    for sizes in ([128, 0, 256], [0, 384]):
        tokens = torch.randn(128 + 256, sum(sizes), generator=gen).to(bf16)  # [N + K, P], tiles along tokens
        ends = torch.tensor(sizes).cumsum(0).to(torch.int64)
        cases.append(("K-grouped", sizes, (*quant.quantize_tiles(tokens[:128]), *quant.quantize_tiles(tokens[128:]),
                                           ends)))
    assert len(triton_grouped.CONFIGS) == 4
    for form, sizes, args in cases:
        want = gemm._grouped_mm_nt(*args, "emulated")
        for config in triton_grouped.CONFIGS:
            got = triton_grouped.grouped_mm_nt(*args, config=config)
            assert got.shape == want.shape and got.dtype == bf16, (form, got.shape, want.shape)
            zero = ~want.reshape(want.shape[0], -1).any(-1)  # rows after the last group / empty groups' gradients
            assert not got.reshape(got.shape[0], -1)[zero].any(), (form, sizes, config)
            if want.any():
                assert sqnr(want, got) >= CLOSE_TO_EMULATED_DB, (form, sizes, config, sqnr(want, got))
            print("ok", form, sizes, config.kwargs, flush=True)


if __name__ == "__main__":
    _check()
