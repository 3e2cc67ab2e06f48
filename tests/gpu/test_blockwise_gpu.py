"""moepass::blockwise_* on CUDA: torch._scaled_mm with DeepSeek's 1x128 / 128x128 scales (sm_90) against the emulated
kernel on the same inputs, DeepGEMM where it is installed and passes its self-check, and the debug model compiled with
recipe="blockwise" training on the real kernels (token counts that change between steps: the op stays opaque to
Inductor, whose _scaled_mm lowering refuses blockwise scales on symbolic shapes)."""

from __future__ import annotations

import math

import pytest
import torch

import moepass.ops  # noqa: F401  (registers the ops)
from moepass.ops.lowp.blockwise import quant
from moepass.ops.lowp.blockwise.kernels import choice, gemm
from helpers import (assert_sqnr, compile_caches_off, forward_backward, grouped_inputs, grouped_reference,
                     linear_inputs, linear_reference, sqnr)

HAS_CUDA = torch.cuda.is_available()
CC = torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
needs_sm90 = pytest.mark.skipif(CC[0] != 9, reason="torch._scaled_mm takes blockwise scales on sm_90 only")
ops = torch.ops.moepass
SQNR_BARS = (27.0, 27.0, 27.0)  # against fp32, as on CPU (test_blockwise_ops.py)
CLOSE_TO_EMULATED_DB = 40.0  # the same quantized operands: fp32 accumulation order and bf16 rounding differ only


def _torch_takes_blockwise_scales() -> str | None:
    """Why this torch build cannot (None: it should on sm_90), so an old build skips rather than fails."""
    if choice._version(torch.__version__) < choice.MIN_TORCH:
        return f"torch {torch.__version__} < 2.11"
    if choice._version(torch.version.cuda) < choice.MIN_CUDA:
        return f"torch built with CUDA {torch.version.cuda} < 12.9"
    return None


@pytest.fixture
def scaled_mm():
    why = _torch_takes_blockwise_scales()
    if why:
        pytest.skip(why)
    return "scaled_mm"


def test_kernel_choice_names_the_device():
    for grouped in (False, True):
        kernel, reason = choice.choose_blockwise_kernel(torch.device("cuda"), grouped)
        assert f"sm_{CC[0]}{CC[1]}" in reason and torch.cuda.get_device_name() in reason, reason
        if CC[0] == 9 and _torch_takes_blockwise_scales() is None:
            assert kernel in (("scaled_mm", "triton", "deepgemm") if grouped else ("scaled_mm",)), reason


@needs_sm90
def test_the_scaled_mm_probe_passes_on_hopper(scaled_mm):
    assert choice.kernel_problem("scaled_mm", torch.device("cuda"), False) is None


@needs_sm90
def test_the_triton_check_passes_on_hopper():
    assert choice.kernel_problem("triton", torch.device("cuda"), True) is None


def _triton():
    problem = choice.kernel_problem("triton", torch.device("cuda"), True)
    if problem:
        pytest.skip(problem)


# ---- the Triton grouped kernels against the emulated GEMM: skewed, empty and partial groups, DeepSeek-V3's dims ----

@pytest.mark.parametrize("sizes, k, n, trailing", [
    ([0, 1, 127, 129, 3000, 0], 256, 384, 7),  # groups off the row tiles, empty first and last groups, trailing rows
    ([4096] * 4, 7168, 2048, 0),  # the 671B dims' expert forward (dgrad: K and N swapped below)
    ([3000, 96, 1000], 2048, 7168, 0)])
def test_triton_m_grouped_gemm_matches_the_emulated_gemm(sizes, k, n, trailing):
    _triton()
    from moepass.ops.lowp.blockwise.kernels import triton_grouped

    gen = torch.Generator().manual_seed(sum(sizes) + k)
    x = torch.randn(sum(sizes) + trailing, k, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(len(sizes), n, k, generator=gen).to("cuda", torch.bfloat16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    args = (*quant.quantize_tiles(x), *quant.quantize_blocks(w), ends)
    got, want = triton_grouped.grouped_mm_nt(*args), gemm._grouped_mm_nt(*args, "emulated")
    assert got.shape == want.shape and sqnr(want, got) >= CLOSE_TO_EMULATED_DB, f"{sqnr(want, got):.1f} dB"
    assert not got[sum(sizes):].any()


@pytest.mark.parametrize("sizes, n, k", [([128, 0, 384, 2048], 384, 256), ([4096] * 4, 2048, 7168)])
def test_triton_k_grouped_gemm_matches_the_emulated_gemm(sizes, n, k):
    _triton()
    from moepass.ops.lowp.blockwise.kernels import triton_grouped

    gen = torch.Generator().manual_seed(sum(sizes) + n)
    a = torch.randn(n, sum(sizes), generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(k, sum(sizes), generator=gen).to("cuda", torch.bfloat16)
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    args = (*quant.quantize_tiles(a), *quant.quantize_tiles(b), ends)
    got, want = triton_grouped.grouped_mm_nt(*args), gemm._grouped_mm_nt(*args, "emulated")
    assert got.shape == want.shape == (len(sizes), n, k) and sqnr(want, got) >= CLOSE_TO_EMULATED_DB
    assert all(not got[i].any() for i, size in enumerate(sizes) if size == 0)


# ---- the GEMM itself: both scale forms, shapes that need padding (M % 16, K / 128 % 4) --------------------

@needs_sm90
@pytest.mark.parametrize("m, k, n", [(256, 512, 256), (200, 384, 128), (1, 128, 256), (4096, 7168, 2048)])
@pytest.mark.parametrize("b_blocks", [True, False], ids=["1x128_128x128", "1x128_1x128"])
def test_scaled_mm_gemm_matches_the_emulated_gemm(scaled_mm, m, k, n, b_blocks):
    gen = torch.Generator().manual_seed(m + k + n)
    a = torch.randn(m, k, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(n, k, generator=gen).to("cuda", torch.bfloat16)
    a_q, a_scale = quant.quantize_tiles(a)
    b_q, b_scale = quant.quantize_blocks(b) if b_blocks else quant.quantize_tiles(b)
    got = gemm.scaled_mm_nt(a_q, a_scale, b_q, b_scale, b_blocks)
    want = gemm.emulated_mm_nt(a_q, a_scale, b_q, b_scale, b_blocks)
    assert got.shape == want.shape == (m, n) and got.dtype == torch.bfloat16
    assert sqnr(want, got) >= CLOSE_TO_EMULATED_DB
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-7 * want.abs().max().item())


# ---- the ops: kernel "scaled_mm" against "emulated" on the same inputs, and against fp32 -----------------

@needs_sm90
@pytest.mark.parametrize("x_shape, n", [((200, 256), 384), ((2, 1000, 1024), 512), ((3, 128), 128)])
def test_linear_scaled_mm_matches_emulated_and_clears_the_bars(scaled_mm, x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=2000, device="cuda")

    def run(kernel):
        return forward_backward(lambda a, b: ops.blockwise_linear(a, b, None, False, kernel), g, x, w)

    got, want = run("scaled_mm"), run("emulated")
    for name, a, b in zip(("out", "grad_x", "grad_w"), got, want):
        assert sqnr(b, a) >= CLOSE_TO_EMULATED_DB, f"{name}: {sqnr(b, a):.1f} dB from emulated"
    assert_sqnr(linear_reference(x, w, g), got, SQNR_BARS, f"linear {x_shape} x {n} on scaled_mm")


@needs_sm90
@pytest.mark.parametrize("kernel", ["scaled_mm", "triton"])
@pytest.mark.parametrize("sizes, k, n, trailing", [([70, 0, 130, 33], 256, 384, 5), ([1024, 512, 2048], 2048, 1536, 0)])
def test_grouped_kernels_match_emulated_and_clear_the_bars(scaled_mm, sizes, k, n, trailing, kernel):
    if kernel == "triton":
        _triton()
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=2100, device="cuda", trailing_tokens=trailing)

    def run(kernel):
        return forward_backward(lambda a, b: ops.blockwise_grouped_mm(a, b, offs, False, kernel), g, x, w_t)

    got, want = run(kernel), run("emulated")
    for name, a, b in zip(("out", "grad_x", "grad_w_t"), got, want):
        assert sqnr(b, a) >= CLOSE_TO_EMULATED_DB, f"{name}: {sqnr(b, a):.1f} dB from emulated"
    end = offs[-1].item()
    assert not got[0][end:].any() and not got[1][end:].any()  # tokens after the last group
    assert_sqnr(grouped_reference(x, w_t, offs, g), got, SQNR_BARS, f"grouped {sizes} on {kernel}")


def test_deepgemm_matches_emulated_where_it_passed_its_self_check():
    problem = choice.kernel_problem("deepgemm", torch.device("cuda"), True)
    if problem:
        pytest.skip(problem)
    x, w_t, offs, g = grouped_inputs([300, 0, 77, 200], 256, 384, seed=2200, device="cuda", trailing_tokens=5)

    def run(kernel):
        return forward_backward(lambda a, b: ops.blockwise_grouped_mm(a, b, offs, False, kernel), g, x, w_t)

    for name, a, b in zip(("out", "grad_x", "grad_w_t"), run("deepgemm"), run("emulated")):
        assert a.shape == b.shape and sqnr(b, a) >= CLOSE_TO_EMULATED_DB, f"{name}: {sqnr(b, a):.1f} dB"


# ---- the model, compiled ----------------------------------------------------------------------------

@needs_sm90
def test_debug_model_compiled_with_recipe_blockwise_trains_on_the_real_kernels(scaled_mm):
    import moepass
    from moepass.harness.train import next_token_loss
    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=2).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moepass", options={"recipe": "blockwise"})
    losses = []
    with moepass.collecting() as report:
        for step, seq_len in enumerate((64, 64, 96, 80)):  # new token counts: a dynamic-shape recompile
            tokens = torch.randint(0, 2048, (2, seq_len), device="cuda",
                                   generator=torch.Generator("cuda").manual_seed(step))
            with torch.no_grad():
                reference = next_token_loss(model(tokens), tokens).item()  # eager BF16, the same weights
            loss = next_token_loss(compiled(tokens), tokens)
            loss.backward()
            assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            assert math.isfinite(losses[-1]) and abs(losses[-1] - reference) / reference < 0.02, (losses, reference)
    torch.cuda.synchronize()
    passes = {p["name"]: p for p in report.to_dict()["passes"]}
    assert passes["grouped_mm"]["replaced"] >= 3 and passes["linear"]["replaced"] >= 12
    assert set(passes["linear"]["implementations"]) == {"scaled_mm"}
    assert set(passes["grouped_mm"]["implementations"]) <= {"scaled_mm", "triton", "deepgemm"}


# ---- Inductor: the decomposed ops (quantization fused by Inductor, the GEMM opaque) against the eager ops --------

DIVISION_ROUNDING = "eager_numerics.division_rounding"  # torch 2.13's Inductor config: fp32 x / y as div_rn in Triton


def _has_inductor_config(key: str) -> bool:
    config = torch._inductor.config
    for part in key.split("."):
        if not hasattr(config, part):
            return False
        config = getattr(config, part)
    return True


@needs_sm90
@pytest.mark.parametrize("division_rounding", [True, False], ids=["div_rn", "triton_default_division"])
@pytest.mark.parametrize("x_shape, n", [((2, 200, 1024), 512), ((3, 128), 256)])
def test_compiled_blockwise_linear_equals_the_eager_op(scaled_mm, division_rounding, x_shape, n):
    """The blockwise linear compiled through the moepass backend (its "scaled_mm" ops decomposed: Triton quantizes,
    moepass::blockwise_scaled_mm runs torch._scaled_mm) against the eager op on the same torch._scaled_mm.

    With Triton's division correctly rounded (Inductor's eager_numerics.division_rounding), bit for bit: the scales
    are amax * fp32(1/448) on both sides (quant.py), amax, clamp and the e4m3 cast (round to nearest even) are exact.
    Triton's default fp32 division (div.full.f32, within 2 ulp) can move a quotient lying within 2 ulp of an e4m3
    rounding midpoint to the other side: a few elements one e4m3 step apart, so the results are only close (SQNR
    >= CLOSE_TO_EMULATED_DB against the eager op, whose GEMM is the same)."""
    import moepass

    if division_rounding and not _has_inductor_config(DIVISION_ROUNDING):
        pytest.skip(f"this torch's Inductor has no {DIVISION_ROUNDING}")
    x, w, g = linear_inputs(x_shape, n, seed=2300, device="cuda")
    fn = lambda a, b: ops.blockwise_linear(a, b, None, False, "scaled_mm")  # noqa: E731
    options = {"recipe": "blockwise", "inductor.options": {DIVISION_ROUNDING: True} if division_rounding else {}}
    torch._dynamo.reset()
    with moepass.collecting() as report, compile_caches_off():
        got = forward_backward(torch.compile(fn, backend="moepass", options=options), g, x, w)
    want = forward_backward(fn, g, x, w)
    compiled = {c["kind"]: c["ops"] for c in report.compiled}
    assert compiled["forward"].get("moepass.blockwise_scaled_mm") == 1, compiled
    assert compiled["backward"].get("moepass.blockwise_scaled_mm") == 2, compiled  # dgrad and wgrad
    gemm_ops = {"moepass.blockwise_scaled_mm", "moepass.blockwise_scaled_grouped_mm"}
    assert not any(op.startswith("moepass.") and op not in gemm_ops for ops_ in compiled.values() for op in ops_), \
        compiled  # no eager quantization inside an opaque blockwise op: Inductor compiled it
    for name, a, b in zip(("out", "grad_x", "grad_w"), got, want):
        if division_rounding:
            assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max()}"
        else:
            assert sqnr(b, a) >= CLOSE_TO_EMULATED_DB, f"{name}: {sqnr(b, a):.1f} dB from the eager op"


@needs_sm90
@pytest.mark.parametrize("kernel, gemm_op", [("scaled_mm", "moepass.blockwise_scaled_grouped_mm"),
                                             ("triton", "moepass.blockwise_triton_grouped_mm")])
def test_compiled_blockwise_grouped_mm_equals_the_eager_op(scaled_mm, kernel, gemm_op):
    """The grouped ops decomposed likewise (per-group token padding of the wgrad in plain torch, no host sync); the
    GEMMs stay in their opaque op (the per-group loop, or the Triton kernels). Bit for bit under div_rn division."""
    import moepass

    if not _has_inductor_config(DIVISION_ROUNDING):
        pytest.skip(f"this torch's Inductor has no {DIVISION_ROUNDING}")
    if kernel == "triton":
        _triton()
    x, w_t, offs, g = grouped_inputs([70, 0, 130, 33], 256, 384, seed=2400, device="cuda", trailing_tokens=5)
    fn = lambda a, b: ops.blockwise_grouped_mm(a, b, offs, False, kernel)  # noqa: E731
    torch._dynamo.reset()
    with moepass.collecting() as report, compile_caches_off():
        got = forward_backward(torch.compile(fn, backend="moepass",
                                             options={"recipe": "blockwise",
                                                      "inductor.options": {DIVISION_ROUNDING: True}}), g, x, w_t)
    want = forward_backward(fn, g, x, w_t)
    compiled = {c["kind"]: c["ops"] for c in report.compiled}
    assert compiled["forward"].get(gemm_op) == 1, compiled
    assert compiled["backward"].get(gemm_op) == 2, compiled
    assert not any(op.startswith("moepass.blockwise_grouped") for ops_ in compiled.values() for op in ops_), compiled
    for name, a, b in zip(("out", "grad_x", "grad_w_t"), got, want):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max()}"
