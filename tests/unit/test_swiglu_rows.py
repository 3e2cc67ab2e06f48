"""quantize_once.swiglu_inputs "fp8": the SwiGLU making an expert GEMM's rows fused with their quantization, gate and up
kept in FP8 for the backward (moepass::fp8_rowwise_swiglu_rows; ops/lowp/swiglu_rows.py, passes/quantize_once.py).
CPU, the recipe's emulated kernel (the numerics of the Triton kernel: tests/gpu/test_swiglu_rows_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY, compile_caches_off

import moepass
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.ops.lowp.fp8_rowwise import quant
from moepass.ops.lowp.fp8_rowwise.kernels import swiglu

OP = torch.ops.moepass.fp8_rowwise_swiglu_rows
FP8 = {"recipe": "fp8_rowwise", "quantize_once.swiglu_inputs": "fp8"}


def _inputs(m=48, k=256, weighted=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(m, 2 * k, generator=gen) * 2).bfloat16()
    weight = torch.rand(m, 1, generator=gen) if weighted else None
    return gate_up[:, :k], gate_up[:, k:], weight  # halves of one GEMM's output, as `gate_up.chunk(2, -1)` gives


@pytest.mark.parametrize("k, tiles", [(256, 2), (96, 1)])  # 1x128 tiles; a row 128 does not divide is one tile
def test_the_rows_are_quantize_rows_of_the_weighted_swiglu_and_gate_up_are_kept_per_tile(k, tiles):
    gate, up, weight = _inputs(k=k)
    h, h_q, h_scale, gate_q, gate_scale, up_q, up_scale = OP(gate, up, weight, "emulated")
    model_h = ((F.silu(gate.float()) * up.float()).bfloat16().float() * weight).bfloat16()  # as the model writes it
    want_q, want_scale = torch.ops.moepass.fp8_rowwise_quantize_rows(model_h, "emulated")
    assert torch.equal(h_scale, want_scale)
    mismatched = (h_q.float() != want_q.float()).float().mean().item()
    assert mismatched < 0.01, mismatched  # silu's last bit (sigmoid vs silu kernels) moves a rare BF16 rounding
    assert h.shape == gate.shape and h.dtype == torch.bfloat16  # the carrier
    assert gate_scale.shape == (gate.shape[0], tiles) and up_scale.shape == gate_scale.shape
    tile = k // tiles
    for t, q, scale in ((gate, gate_q, gate_scale), (up, up_q, up_scale)):
        want_q, want_scale = quant.quantize(t.reshape(t.shape[0], tiles, tile), -1)
        assert torch.equal(scale, want_scale.reshape(-1, tiles))
        assert torch.equal(q.view(torch.uint8), want_q.reshape(q.shape).view(torch.uint8))


def test_the_backward_is_swiglus_on_the_fp8_inputs_with_the_routing_weights_gradient():
    gate, up, weight = _inputs()
    leaves = [t.detach().clone().requires_grad_() for t in (gate, up, weight)]
    grad = torch.randn(gate.shape).bfloat16()
    OP(*leaves, "emulated")[0].backward(grad)
    # reference: the same math in fp64 on the FP8 values the op keeps
    g, u = (swiglu.dequantize_tiles(*swiglu.quantize_tiles(t)).double().requires_grad_() for t in (gate, up))
    w = weight.double().requires_grad_()
    ((F.silu(g) * u) * w).backward(grad.double())
    for got, want in zip(leaves, (g, u, w)):
        assert _error(got.grad, want.grad) < 2 ** -8  # BF16 roundings of h and of the gradients
    # ... and within FP8's error of the exact gradients
    exact = [t.detach().double().requires_grad_() for t in (gate, up, weight)]
    ((F.silu(exact[0]) * exact[1]) * exact[2]).backward(grad.double())
    for got, want in zip(leaves, exact):
        assert 1e-4 < _error(got.grad, want.grad) < 0.06  # e4m3's 3 mantissa bits: a few percent, and not zero


def _error(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def test_the_op_rejects_what_it_cannot_take():
    gate, up, weight = _inputs()
    with pytest.raises(ValueError, match="bfloat16"):
        OP(gate.float(), up, weight, "emulated")
    with pytest.raises(ValueError, match="one shape"):
        OP(gate, up[:, :128], weight, "emulated")
    with pytest.raises(ValueError, match=r"\[48, 1\] column"):
        OP(gate, up, weight.view(-1), "emulated")


def _step(model, tokens, options):
    model.zero_grad()
    with moepass.collecting() as report, compile_caches_off():
        compiled = torch.compile(model, backend="moepass", options=options)
        loss = next_token_loss(compiled(tokens), tokens)
        loss.backward()
    torch._dynamo.reset()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, report


def test_a_moe_step_fuses_the_experts_swiglu_with_its_routing_weights_and_keeps_the_forward():
    torch.manual_seed(0)
    model = build_model("debug", **{**TINY, "moe_inter_dim": 256})  # one dense, one MoE layer
    tokens = torch.randint(0, TINY["vocab_size"], (2, 32))
    loss, grads, _ = _step(model, tokens, {"recipe": "fp8_rowwise"})
    loss_fp8, grads_fp8, report = _step(model, tokens, FP8)
    rewrites = [r for p in report.pass_totals() if p.name == "quantize_once" for r in p.rewrites
                if r.op == "moepass.fp8_rowwise_swiglu_rows"]
    assert len(rewrites) == 1 and rewrites[0].module == "layers.1.moe.experts", rewrites
    assert "routing weights" in rewrites[0].detail
    forward = next(c for c in report.compiled if c["kind"] == "forward")
    assert forward["ops"].get("moepass.fp8_rowwise_swiglu_rows") == 1
    assert forward["ops"].get("moepass.fp8_rowwise_quantize_rows") == 1  # w1 and w3's shared rows only
    torch.testing.assert_close(loss_fp8, loss, rtol=1e-4, atol=1e-4)  # the forward's rows are the same
    assert grads_fp8.keys() == grads.keys()
    for name, g in grads.items():  # only the backward through the SwiGLU's FP8 copies differs
        error = ((grads_fp8[name] - g).norm() / g.norm()).item()
        assert error < 0.1, (name, error)
    assert (grads_fp8["layers.1.moe.experts.w1"] != grads["layers.1.moe.experts.w1"]).any()


def test_gate_read_elsewhere_keeps_the_swiglu_and_says_why():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2, self.w3 = (torch.nn.Parameter(torch.randn(4, 64, 64).bfloat16() * 0.1)
                                         for _ in range(3))

        def forward(self, x, offs):
            gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offs)
            out = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)
            return out, gate.float().square().mean()  # gate also feeds an auxiliary term

    x = torch.randn(64, 64).bfloat16().requires_grad_()
    offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
    with moepass.collecting() as report, compile_caches_off():
        out, aux = torch.compile(Experts(), backend="moepass", options=FP8)(x, offs)
        (out.float().sum() + aux).backward()
    torch._dynamo.reset()
    skips = [s for p in report.pass_totals() for s in p.skipped if s.code is not None
             and s.code.name == "SWIGLU_STAYS_BF16"]
    assert len(skips) == 1 and "gate" in skips[0].reason and "read elsewhere" in skips[0].reason, skips
    assert not any(c["ops"].get("moepass.fp8_rowwise_swiglu_rows") for c in report.compiled)


def test_the_default_keeps_bf16_inputs():
    torch.manual_seed(0)
    model = build_model("debug", **{**TINY, "moe_inter_dim": 256})
    tokens = torch.randint(0, TINY["vocab_size"], (2, 32))
    _, _, report = _step(model, tokens, {"recipe": "fp8_rowwise"})
    assert not any(c["ops"].get("moepass.fp8_rowwise_swiglu_rows") for c in report.compiled)


def test_no_rows_an_ep_rank_may_receive():
    gate, up, weight = (t.requires_grad_() for t in (torch.zeros(0, 256).bfloat16(), torch.zeros(0, 256).bfloat16(),
                                                     torch.zeros(0, 1)))
    out = OP(gate, up, weight, "emulated")
    assert [tuple(t.shape) for t in out] == [(0, 256), (0, 256), (0, 1), (0, 256), (0, 2), (0, 256), (0, 2)]
    out[0].sum().backward()
    assert gate.grad.shape == (0, 256) and weight.grad.shape == (0, 1)
