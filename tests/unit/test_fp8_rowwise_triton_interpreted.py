"""moepass's FP8-rowwise Triton kernels (ops/lowp/fp8_rowwise/kernels/triton_*.py) on CPU, under Triton's interpreter:
- both_layouts: the per-tile amax pass on shapes that end inside a tile, with several experts, and the scales
  both_layouts derives from it;
- token_group_cols_padded on FP8 rows with their scales (the wgrad on the rows quantize_once saved): every output
  bit equal to the kernel's on the rows' BF16 dequantization, empty groups and trailing rows included.
The interpreter must be on before triton is imported, so the checks run in a child process (this file run as a
script). Triton 3.9's interpreter casts to e4m3 wrongly where rounding carries into the exponent (127.5 -> 64), so FP8
data is compared with the reference on the GPU only (tests/gpu/test_fp8_rowwise_gpu.py); here the row-scaled kernel is
compared with the same kernel on BF16 input, which goes through the same cast."""

from __future__ import annotations

import importlib.util

import pytest

CASES = [(1, 300, 200), (3, 97, 130), (2, 513, 64), (1, 64, 48)]  # [E, R, C]; 300 rows end inside a 256-row tile
# token group sizes, trailing rows past the last group, columns: empty groups, a group over many row blocks
TOKEN_GROUP_CASES = [([10, 0, 50, 40], 7, 96), ([300, 3, 0], 0, 40)]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_tile_amax_both_layouts_scales_and_token_groups_on_fp8_rows():
    from helpers import run_under_triton_interpreter  # the child runs this file without tests/ on its path

    run_under_triton_interpreter(__file__, len(CASES) + len(TOKEN_GROUP_CASES), timeout=600)


def _check() -> None:
    import torch

    from moepass.ops.lowp.fp8_rowwise.kernels import triton_both_layouts
    from moepass.ops.lowp.fp8_rowwise.quant import scale_from_amax

    gen = torch.Generator().manual_seed(0)
    for experts, r, c in CASES:
        # rows of very different magnitudes, so a row's or a column's amax comes from one element
        t = torch.randn(experts, r, c, generator=gen) * torch.rand(experts, r, 1, generator=gen) * 10
        t = t.to(torch.bfloat16)
        row_amax, col_amax = triton_both_layouts.tile_amax(t, tile_r=64, load_r=16, tile_c=32)  # many tiles per operand
        assert torch.equal(row_amax, t.abs().amax(-1).float()), (experts, r, c)
        assert torch.equal(col_amax, t.abs().amax(-2).float()), (experts, r, c)
        q_rows, row_scale, q_cols, col_scale = triton_both_layouts.both_layouts(t)
        assert torch.equal(row_scale, scale_from_amax(t.abs().amax(-1).float()))
        assert torch.equal(col_scale, scale_from_amax(t.abs().amax(-2).float()))
        assert q_rows.shape == t.shape and q_cols.shape == t.mT.shape
        print("ok", experts, r, c, flush=True)
    _check_token_groups_on_fp8_rows(gen)


def _check_token_groups_on_fp8_rows(gen) -> None:
    import torch

    from moepass.ops.lowp.fp8_rowwise import quant
    from moepass.ops.lowp.fp8_rowwise.kernels.triton_token_group_cols import token_group_cols_padded

    for sizes, trailing, d in TOKEN_GROUP_CASES:
        x = (torch.randn(sum(sizes) + trailing, d, generator=gen) * torch.rand(sum(sizes) + trailing, 1, generator=gen)
             * 100).to(torch.bfloat16)
        x_q, x_scale = quant.rows(x, "emulated")
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        got = token_group_cols_padded(x_q, offs, x_scale, block_m=32)  # several row blocks a group
        want = token_group_cols_padded(quant.dequantize(x_q, x_scale), offs, block_m=32)
        ends = int(want[2][-1])  # columns past the padded groups are not written
        assert torch.equal(got[0][:, :ends].view(torch.uint8), want[0][:, :ends].view(torch.uint8)), (sizes, d)
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), (sizes, d)
        print("ok token groups", sizes, trailing, d, flush=True)


if __name__ == "__main__":
    _check()
