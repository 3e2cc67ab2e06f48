"""The FP8-rowwise SwiGLU's Triton kernel (ops/lowp/fp8_rowwise/kernels/triton_swiglu.py) on CPU, under Triton's
interpreter, against the op's torch path: strided halves of one tensor, 1x128 tiles and a whole-row tile, with and
without routing weights. Scales must be equal. Triton 3.9's interpreter casts to e4m3 wrongly at ties (it rounds them
away from zero), where the result is a power of two (127.5 -> 64, 2.0 -> 1.0) and in subnormals (it truncates), so FP8
data may differ from torch's only there; tests/gpu/test_swiglu_rows_gpu.py compares every bit on the GPU. The
interpreter must be on before triton is imported, so the checks run in a child process (this file run as a script)."""

from __future__ import annotations

import importlib.util

import pytest

CASES = [(5, 256, True), (3, 96, False), (4, 384, True), (1, 1408, False)]  # [M, K, routing weights]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_kernel_equals_the_torch_path():
    from helpers import run_under_triton_interpreter  # the child runs this file without tests/ on its path

    run_under_triton_interpreter(__file__, len(CASES))


def _only_interpreter_casts_differ(got, want, scaled, step: bool = False) -> None:
    """got and want e4m3 of `scaled` (fp32) agree but at ties and at roundings that carry into the exponent (and,
    with `step`, by one e4m3 step: h's last BF16 bit may differ, from numpy's exp against torch's)."""
    import torch

    got, want, scaled = got.float(), want.float(), scaled.float()
    ok = (got == want) | ((got - scaled).abs() == (want - scaled).abs())  # equal, or a tie
    ok |= (want.abs() >= scaled.abs()) & (torch.frexp(want).mantissa.abs() == 0.5)  # rounded onto a power of two
    ok |= (scaled.abs() < 2 ** -6) & ((got - want).abs() <= 2 ** -9)  # subnormals: the interpreter truncates
    if step:
        ok |= (got - want).abs() <= want.abs() * 2 ** -3
    assert ok.all(), torch.stack([scaled, want, got])[:, ~ok]


def _check() -> None:
    import torch

    from moepass.ops.lowp.fp8_rowwise.kernels import swiglu
    from moepass.ops.lowp.fp8_rowwise.kernels.triton_swiglu import swiglu_rows

    gen = torch.Generator().manual_seed(0)
    for m, k, weighted in CASES:
        gate_up = (torch.randn(m, 2 * k, generator=gen) * torch.rand(m, 1, generator=gen) * 8).bfloat16()
        gate, up = gate_up[:, :k], gate_up[:, k:]  # strided rows
        weight = torch.rand(m, 1, generator=gen) if weighted else None
        want = swiglu.forward(gate, up, weight, "emulated")
        got = swiglu_rows(gate, up, weight, swiglu.tile_width(k))
        assert [(t.dtype, t.shape) for t in got] == [(t.dtype, t.shape) for t in want]
        for i in (1, 3, 5):
            assert torch.equal(got[i], want[i]), (m, k, i)
        tile = swiglu.tile_width(k)
        for i, t in ((2, gate), (4, up)):
            scaled = (t.float().reshape(m, -1, tile) * want[i + 1].unsqueeze(-1)).reshape(m, k)
            _only_interpreter_casts_differ(got[i], want[i], scaled)
        h = swiglu._silu_times(gate.float(), up.float())
        if weighted:
            h = (h.float() * weight).bfloat16()
        _only_interpreter_casts_differ(got[0], want[0], h.float() * want[1], step=True)
        print("ok", m, k, weighted, flush=True)


if __name__ == "__main__":
    _check()
