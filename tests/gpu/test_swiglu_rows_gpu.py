"""moepass::fp8_rowwise_swiglu_rows on CUDA (the Triton kernel): gate and up quantized bit for bit as the torch path
quantizes them, h's rows as quantize_rows makes them, and a compiled MoE step with quantize_once.swiglu_inputs "fp8"
whose forward holds the fused op and whose gradients stay within FP8's error of the default's."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, compile_caches_off

import moepass
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.ops.lowp.fp8_rowwise.kernels import swiglu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                                 reason="e4m3 casts need sm_89+")]

OP = torch.ops.moepass.fp8_rowwise_swiglu_rows


@pytest.mark.parametrize("m, k, weighted", [(8192, 2048, True), (3000, 1408, False), (17, 96, True), (0, 256, True)])
def test_kernel_quantizes_as_the_torch_path(m, k, weighted):
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    gate_up = (torch.randn(m, 2 * k, device="cuda", generator=gen) * 4).bfloat16()
    gate, up = gate_up[:, :k], gate_up[:, k:]  # strided halves, as `gate_up.chunk(2, -1)` gives
    weight = torch.rand(m, 1, device="cuda", generator=gen) if weighted else None
    got = OP(gate, up, weight, "scaled_mm")[1:]
    want = OP(gate.cpu(), up.cpu(), None if weight is None else weight.cpu(), "emulated")[1:]
    for i in (1, 2, 3, 4, 5):  # h's scale, gate and up: the same bits
        assert torch.equal(got[i].cpu().view(torch.uint8) if got[i].element_size() == 1 else got[i].cpu(),
                           want[i].view(torch.uint8) if want[i].element_size() == 1 else want[i]), i
    if m:  # h: silu's last bit differs between CUDA's and the CPU's kernels, moving a rare BF16 rounding
        assert (got[0].cpu().float() != want[0].float()).float().mean() < 0.01


def test_a_compiled_moe_step_fuses_the_swiglu_and_tracks_the_default():
    torch.manual_seed(0)
    model = build_model("debug", **{**TINY, "moe_inter_dim": 256}).cuda()
    tokens = torch.randint(0, TINY["vocab_size"], (4, 64), device="cuda")
    runs = []
    for options in ({"recipe": "fp8_rowwise"}, {"recipe": "fp8_rowwise", "quantize_once.swiglu_inputs": "fp8"}):
        model.zero_grad()
        with moepass.collecting() as report, compile_caches_off():
            loss = next_token_loss(torch.compile(model, backend="moepass", options=options)(tokens), tokens)
            loss.backward()
        torch._dynamo.reset()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                     report))
    (loss, grads, _), (loss_fp8, grads_fp8, report) = runs
    forward = next(c for c in report.compiled if c["kind"] == "forward")
    assert forward["ops"].get("moepass.fp8_rowwise_swiglu_rows") == 1, forward["ops"]
    torch.testing.assert_close(loss_fp8, loss, rtol=1e-3, atol=1e-3)
    for name, g in grads.items():
        assert ((grads_fp8[name] - g).norm() / g.norm()).item() < 0.1, name
