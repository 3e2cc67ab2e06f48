"""moepass::fp8_rowwise_* ops and the recipe choice, on CPU (kernel "emulated"; GPU tests in test_fp8_rowwise_gpu.py).

Bit-level agreement with a quantization written here independently, accuracy bars, token groups of any
size, opcheck, compile, bad inputs, and choose_recipe on CPU / sm_89 / sm_90 / sm_100 (capability mocked).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moepass.ops.lowp.fp8_rowwise  # noqa: F401  (registers the ops)
from moepass.ops.lowp.fp8_rowwise.kernels.choice import choose_fp8_rowwise_kernel
from moepass.ops.lowp.fp8_rowwise.recipe import FP8_ROWWISE
from moepass.recipes import auto, auto_table
from moepass.recipes.plan import resolve_recipe
from moepass.recipes.registry import RECIPES
from moepass.skips import SkipCode
from moepass.options import OptionsError
from helpers import FP8_ROWWISE_SQNR_BARS as SQNR_BARS
from helpers import (OpsCalled, assert_all_equal, assert_sqnr, block_inputs, call_targets, forward_backward,
                     grouped_inputs, grouped_reference, linear_inputs, linear_reference, recording_backend, sqnr)
from helpers import fp8_rowwise_op_grouped as op_grouped
from helpers import fp8_rowwise_op_linear as op_linear

ops = torch.ops.moepass
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


# ---- a second, independent writing of the recipe: per-row power-of-two scales, e4m3, BF16 GEMM ----

def hand_quantize(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """2^floor(log2(448 / amax)) per slice along `dim`, in float64 math; e4m3 with saturation."""
    amax = t.double().abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    q = (t.double() * scale).clamp(-448, 448).float().to(E4M3)
    return q, scale


def hand_matmul(a_q, a_scale, b_q, b_scale) -> torch.Tensor:
    """(a_q / a_scale) @ (b_q / b_scale) with the operands in BF16 (exact: power-of-two scales)."""
    a = (a_q.double() / a_scale).to(BF16)
    b = (b_q.double() / b_scale).to(BF16)
    return a @ b


def hand_linear(x, w, g):
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    out = hand_matmul(*hand_quantize(x2, 1), *(t.transpose(0, 1) for t in hand_quantize(w, 1)))
    grad_x = hand_matmul(*hand_quantize(g2, 1), *hand_quantize(w, 0))
    gq, gs = hand_quantize(g2, 0)
    grad_w = hand_matmul(gq.t(), gs.t(), *hand_quantize(x2, 0))
    return out.reshape(g.shape), grad_x.reshape(x.shape), grad_w


def hand_grouped(x, w_t, offs, g):
    """Per group: torch._grouped_mm's semantics; tokens past offs[-1] give zero outputs and gradients."""
    out, grad_x = torch.zeros_like(g), torch.zeros_like(x)
    grad_w_t = torch.zeros(w_t.shape, dtype=BF16)
    xq, xs = hand_quantize(x, 1)
    gq, gs = hand_quantize(g, 1)
    wq_k, ws_k = hand_quantize(w_t, 1)  # forward: each output channel along K
    wq_n, ws_n = hand_quantize(w_t, 2)  # dgrad: each input channel along N
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        if end > start:
            out[rows] = hand_matmul(xq[rows], xs[rows], wq_k[e], ws_k[e])
            grad_x[rows] = hand_matmul(gq[rows], gs[rows], wq_n[e].t(), ws_n[e].t())
            x_colq, x_cols = hand_quantize(x[rows], 0)
            g_colq, g_cols = hand_quantize(g[rows], 0)
            grad_w_t[e] = hand_matmul(g_colq.t(), g_cols.t(), x_colq, x_cols).t()  # the op's orientation
        start = end
    return out, grad_x, grad_w_t


# ---- schemas and kernel choice -------------------------------------------------------------------

def test_op_schemas_are_the_published_contract():
    want = {
        "fp8_rowwise_linear": "Tensor x, Tensor weight, Tensor? bias, bool wgrad_bf16, str kernel",
        "fp8_rowwise_linear_dgrad": "Tensor grad_out, Tensor weight, str kernel",
        "fp8_rowwise_linear_wgrad": "Tensor grad_out, Tensor x, str kernel",
        "fp8_rowwise_grouped_mm": "Tensor x, Tensor w_t, Tensor offs, bool wgrad_bf16, str kernel",
        "fp8_rowwise_grouped_mm_dgrad": "Tensor grad_out, Tensor w_t, Tensor offs, str kernel",
        "fp8_rowwise_grouped_mm_wgrad": "Tensor grad_out, Tensor x, Tensor offs, str kernel",
    }
    for name, args in want.items():
        assert str(getattr(ops, name).default._schema) == f"moepass::{name}({args}) -> Tensor"


@pytest.mark.parametrize("grouped", [False, True])
def test_cpu_chooses_emulated_with_a_reason(grouped):
    kernel, reason = choose_fp8_rowwise_kernel(torch.device("cpu"), grouped)
    assert kernel == "emulated" and "CPU" in reason and "emulated" in reason


# ---- bit for bit against the hand-written recipe ------------------------------------------------

@pytest.mark.parametrize("x_shape, n", [((64, 64), 96), ((2, 24, 128), 64), ((50, 32), 48), ((7, 256), 16)])
def test_linear_equals_hand_written_recipe(x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=sum(x_shape) + n)
    assert_all_equal(op_linear(x, w, g), hand_linear(x, w, g), f"linear {x_shape} N={n}")


@pytest.mark.parametrize("group_sizes", [[10, 0, 50, 40], [33, 31, 1, 0], [64, 16], [5]])
def test_grouped_equals_hand_written_recipe(group_sizes):
    x, w_t, offs, g = grouped_inputs(group_sizes, 64, 48, seed=sum(group_sizes))
    got = op_grouped(x, w_t, offs, g)
    assert_all_equal(got, hand_grouped(x, w_t, offs, g), f"grouped {group_sizes}")
    assert got[2].shape == w_t.shape and got[2].stride() == w_t.stride()


def test_emulated_linear_equals_torch_scaled_mm_on_the_same_operands():
    """The emulation's scale convention is torch._scaled_mm's (which has a CPU kernel)."""
    x, w, _ = linear_inputs((48, 64), 32, seed=5)
    xq, xs = hand_quantize(x, 1)
    wq, ws = hand_quantize(w, 1)
    want = torch._scaled_mm(xq, wq.t(), scale_a=xs.reciprocal().float(), scale_b=ws.reciprocal().float().t(),
                            out_dtype=BF16)
    assert torch.equal(ops.fp8_rowwise_linear(x, w, None, False, "emulated"), want)


def test_scales_are_powers_of_two_and_the_row_max_lands_in_the_top_binade():
    from moepass.ops.lowp.fp8_rowwise import quant

    t = torch.randn(32, 64).to(BF16) * torch.logspace(-6, 6, 64, base=2).to(BF16)
    q, scale = quant.quantize(t, 0)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    top = q.float().abs().amax(0)
    assert ((top >= 224) & (top <= 448)).all()  # amax * 2^k lands in (224, 448], e4m3 rounding may give 224
    zeros = quant.quantize(torch.zeros(4, 16, dtype=BF16), 1)
    assert not zeros[0].float().any() and torch.isfinite(zeros[1]).all()


# ---- accuracy against an fp32 reference of the bf16 inputs ----------------------------------------

LINEAR_SHAPES = [((64, 64), 96), ((2, 48, 128), 64), ((50, 256), 256), ((7, 32), 32), ((1000, 16), 48)]
GROUPED_SHAPES = [([10, 0, 50, 40], 64, 96), ([33, 31, 70], 256, 128), ([5], 32, 32), ([1, 15, 17, 0, 100], 48, 80)]


@pytest.mark.parametrize("case", range(len(LINEAR_SHAPES)))
def test_linear_sqnr(case):
    x_shape, n = LINEAR_SHAPES[case]
    x, w, g = linear_inputs(x_shape, n, seed=100 + case)
    assert_sqnr(linear_reference(x, w, g), op_linear(x, w, g), SQNR_BARS, f"linear {x_shape} N={n}")


@pytest.mark.parametrize("case", range(len(GROUPED_SHAPES)))
def test_grouped_sqnr(case):
    sizes, k, n = GROUPED_SHAPES[case]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=200 + case)
    assert_sqnr(grouped_reference(x, w_t, offs, g), op_grouped(x, w_t, offs, g), SQNR_BARS, f"grouped {sizes} K={k} N={n}")


def test_each_token_group_alone_clears_the_bars():
    x, w_t, offs, g = grouped_inputs([33, 1, 63, 17], 64, 96, seed=250)
    got, ref = op_grouped(x, w_t, offs, g), grouped_reference(x, w_t, offs, g)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        assert_sqnr((ref[0][rows], ref[1][rows], ref[2][e]), (got[0][rows], got[1][rows], got[2][e]),
                    SQNR_BARS, f"group {e}")
        start = end


def test_power_of_two_scales_cost_under_one_db_against_exact_scales():
    """Why scales are rounded to 2^k: exact dequantization for well under 1 dB of SQNR."""
    x, w, _ = linear_inputs((256, 512), 256, seed=260)
    ref = linear_reference(x, w, torch.zeros(256, 256, dtype=BF16))[0]

    def exact_scale(t):
        scale = 448.0 / t.double().abs().amax(1, keepdim=True)
        return (t.double() * scale).clamp(-448, 448).float().to(E4M3).double() / scale

    exact = (exact_scale(x) @ exact_scale(w).T).to(BF16)
    pow2 = ops.fp8_rowwise_linear(x, w, None, False, "emulated")
    assert sqnr(ref, exact) - 1.0 < sqnr(ref, pow2) <= sqnr(ref, exact) + 1.0


def test_wgrad_bf16_is_clearly_more_accurate():
    x, w, g = linear_inputs((50, 128), 64, seed=300)
    ref = linear_reference(x, w, g)[2]
    assert sqnr(ref, op_linear(x, w, g, wgrad_bf16=True)[2]) > sqnr(ref, op_linear(x, w, g)[2]) + 15
    x, w_t, offs, g = grouped_inputs([33, 0, 31, 70], 128, 64, seed=301)
    ref = grouped_reference(x, w_t, offs, g)[2]
    assert sqnr(ref, op_grouped(x, w_t, offs, g, wgrad_bf16=True)[2]) > sqnr(ref, op_grouped(x, w_t, offs, g)[2]) + 15


# ---- token groups: empty, unaligned, and tokens outside every group -------------------------------

@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_tokens_after_last_group_give_zeros_and_do_not_touch_grads(wgrad_bf16):
    x, w_t, offs, g = grouped_inputs([10, 0, 45], 64, 64, seed=400, trailing_tokens=23)
    inside = int(offs[-1])
    x[inside:], g[inside:] = 1e4, 1e4  # loud values: any leak would show
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g, wgrad_bf16=wgrad_bf16)
    assert not out[inside:].any() and not grad_x[inside:].any()
    want = op_grouped(x[:inside], w_t, offs, g[:inside], wgrad_bf16=wgrad_bf16)
    assert_all_equal((out[:inside], grad_x[:inside], grad_w_t), want, "trailing tokens")


def test_empty_group_gets_exactly_zero_weight_grad():
    x, w_t, offs, g = grouped_inputs([40, 0, 30], 64, 64, seed=401)
    for wgrad_bf16 in (False, True):
        assert not op_grouped(x, w_t, offs, g, wgrad_bf16=wgrad_bf16)[2][1].any()


def test_zero_tokens():
    x, w, g = linear_inputs((0, 64), 32, seed=402)
    out, grad_x, grad_w = op_linear(x, w, g)
    assert out.shape == (0, 32) and grad_x.shape == (0, 64) and not grad_w.any()
    x, w_t, offs, g = grouped_inputs([0, 0], 32, 16, seed=403)
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g)
    assert out.shape == (0, 16) and grad_x.shape == (0, 32) and not grad_w_t.any()


# ---- bias -----------------------------------------------------------------------------------------

def test_bias_is_added_after_the_gemm_and_its_grad_is_the_token_sum():
    x, w, g = linear_inputs((2, 40, 64), 96, seed=500)
    bias = torch.randn(96).to(BF16)
    out_b, grad_x_b, grad_w_b, grad_b = forward_backward(
        lambda a, b, c: ops.fp8_rowwise_linear(a, b, c, False, "emulated"), g, x, w, bias)
    out, grad_x, grad_w = op_linear(x, w, g)
    assert torch.equal(out_b, out + bias)
    assert torch.equal(grad_x_b, grad_x) and torch.equal(grad_w_b, grad_w)
    assert torch.equal(grad_b, g.reshape(-1, 96).float().sum(0).to(BF16))


# ---- opcheck --------------------------------------------------------------------------------------

def _opcheck_cases():
    x, w, g = linear_inputs((2, 20, 64), 32, seed=600)
    xg, w_t, offs, gg = grouped_inputs([5, 0, 27], 64, 32, seed=601, trailing_tokens=3)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    return {
        "linear": (ops.fp8_rowwise_linear, (leaf(x), leaf(w), leaf(torch.randn(32).to(BF16)), False, "emulated")),
        "linear_wgrad_bf16": (ops.fp8_rowwise_linear, (leaf(x), leaf(w), None, True, "emulated")),
        "linear_dgrad": (ops.fp8_rowwise_linear_dgrad, (g, w, "emulated")),
        "linear_wgrad": (ops.fp8_rowwise_linear_wgrad, (g, x, "emulated")),
        "grouped": (ops.fp8_rowwise_grouped_mm, (leaf(xg), leaf(w_t), offs, False, "emulated")),
        "grouped_wgrad_bf16": (ops.fp8_rowwise_grouped_mm, (leaf(xg), leaf(w_t), offs, True, "emulated")),
        "grouped_dgrad": (ops.fp8_rowwise_grouped_mm_dgrad, (gg, w_t, offs, "emulated")),
        "grouped_wgrad": (ops.fp8_rowwise_grouped_mm_wgrad, (gg, xg, offs, "emulated")),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op.default, args)


# ---- torch.compile ---------------------------------------------------------------------------------

def _moe_block(x, w, bias, w_t, offs, wgrad_bf16):
    h = ops.fp8_rowwise_linear(x, w, bias, wgrad_bf16, "emulated")
    return ops.fp8_rowwise_grouped_mm(h.reshape(-1, h.shape[-1]), w_t, offs, wgrad_bf16, "emulated")


@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_aot_backward_graph_holds_the_quantized_backward_ops(wgrad_bf16):
    x, w, bias, w_t, offs, g = block_inputs(seed=700)
    graphs = {}
    compiled = torch.compile(lambda *a: _moe_block(*a, wgrad_bf16), backend=recording_backend(graphs), fullgraph=True)
    forward_backward(compiled, g, x, w, bias, w_t, offs)
    assert {ops.fp8_rowwise_linear.default, ops.fp8_rowwise_grouped_mm.default} <= call_targets(graphs["fw"])
    bw = call_targets(graphs["bw"])
    assert {ops.fp8_rowwise_linear_dgrad.default, ops.fp8_rowwise_grouped_mm_dgrad.default} <= bw
    wgrads = {ops.fp8_rowwise_linear_wgrad.default, ops.fp8_rowwise_grouped_mm_wgrad.default}
    if wgrad_bf16:
        assert not wgrads & bw and {torch.ops.aten.mm.default, ops.grouped_mm_wgrad_bf16.default} <= bw
    else:
        assert wgrads <= bw


# The Inductor case has no bias: the bias-grad sum would be a ~30 s cold C++ compile on 2 cores.
@pytest.mark.parametrize("backend, wgrad_bf16, with_bias", [("aot_eager", False, True), ("aot_eager", True, True),
                                                            ("inductor", False, False)])
def test_compiled_equals_eager_bit_for_bit(backend, wgrad_bf16, with_bias):
    x, w, bias, w_t, offs, g = block_inputs(seed=800)
    bias = bias if with_bias else None
    fn = lambda *a: _moe_block(*a, wgrad_bf16)  # noqa: E731
    torch._dynamo.reset()
    got = forward_backward(torch.compile(fn, backend=backend, fullgraph=True), g, x, w, bias, w_t, offs)
    want = forward_backward(fn, g, x, w, bias, w_t, offs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_dynamic_token_count_compiles_once():
    counts = []

    def backend(gm, example_inputs):
        counts.append(1)
        return gm.forward

    fn = torch.compile(lambda x, w: ops.fp8_rowwise_linear(x, w, None, False, "emulated"), backend=backend,
                       dynamic=True)
    for m in (40, 72, 17):
        x, w, _ = linear_inputs((m, 64), 32, seed=m)
        assert torch.equal(fn(x, w), ops.fp8_rowwise_linear(x, w, None, False, "emulated"))
    assert len(counts) == 1


# ---- bad inputs ----------------------------------------------------------------------------------

def test_rejects_non_bf16_naming_the_dtype():
    x, w, _ = linear_inputs((32, 64), 32, seed=900)
    with pytest.raises(ValueError, match=r"x is torch\.float32.*bfloat16"):
        ops.fp8_rowwise_linear(x.float(), w, None, False, "emulated")
    xg, w_t, offs, _ = grouped_inputs([32], 64, 32, seed=901)
    with pytest.raises(ValueError, match=r"w_t is torch\.float16.*bfloat16"):
        ops.fp8_rowwise_grouped_mm(xg, w_t.half(), offs, False, "emulated")


def test_rejects_dims_not_multiple_of_16_naming_the_fix():
    x, w, _ = linear_inputs((32, 40), 32, seed=902)
    with pytest.raises(ValueError, match=r"K=40 is not a multiple of 16.*pad K"):
        ops.fp8_rowwise_linear(x, w, None, False, "emulated")
    x, w, _ = linear_inputs((32, 64), 24, seed=903)
    with pytest.raises(ValueError, match=r"N=24 is not a multiple of 16"):
        ops.fp8_rowwise_linear(x, w, None, False, "emulated")
    xg, w_t, offs, _ = grouped_inputs([32], 48, 8, seed=904)
    with pytest.raises(ValueError, match=r"N=8 is not a multiple of 16"):
        ops.fp8_rowwise_grouped_mm(xg, w_t, offs, False, "emulated")


def test_rejects_bad_kernel_names_naming_the_valid_ones():
    x, w, _ = linear_inputs((32, 64), 32, seed=905)
    with pytest.raises(ValueError, match=r"'emulated', 'scaled_mm'"):
        ops.fp8_rowwise_linear(x, w, None, False, "cutlass")


def test_rejects_bad_offs():
    xg, w_t, offs, g = grouped_inputs([16, 16], 64, 32, seed=906)
    with pytest.raises(ValueError, match=r"offs must be int32"):
        ops.fp8_rowwise_grouped_mm(xg, w_t, offs.long(), False, "emulated")
    with pytest.raises(ValueError, match=r"offs must be int32 \[E\].*E=2"):
        ops.fp8_rowwise_grouped_mm(xg, w_t, offs[:1], False, "emulated")
    with pytest.raises(ValueError, match=r"offs must be int32"):
        ops.fp8_rowwise_grouped_mm_wgrad(g, xg, offs[:0], "emulated")


def test_scaled_mm_kernel_on_cpu_raises_and_points_to_emulated():
    x, w, _ = linear_inputs((32, 64), 32, seed=907)
    with pytest.raises(RuntimeError, match=r"kernel='scaled_mm' cannot run here: CPU.*kernel='emulated'"):
        ops.fp8_rowwise_linear(x, w, None, False, "scaled_mm")


def test_fake_impls_check_arguments_at_trace_time():
    with FakeTensorMode():
        x, w = torch.empty(32, 40, dtype=BF16), torch.empty(32, 40, dtype=BF16)
        with pytest.raises(ValueError, match=r"K=40"):
            ops.fp8_rowwise_linear(x, w, None, False, "emulated")
        xg, w_t = torch.empty(8, 64, dtype=BF16), torch.empty(2, 64, 32, dtype=BF16)
        with pytest.raises(ValueError, match=r"offs must be int32"):
            ops.fp8_rowwise_grouped_mm(xg, w_t, torch.empty(2, dtype=torch.int64), False, "emulated")


# ---- recipe choice ---------------------------------------------------------------------------------

@pytest.fixture
def cuda_capability(monkeypatch):
    """Pretend this process sees one CUDA GPU of the given compute capability (sm_90: an H200, whose shipped table
    recipe auto reads; tests/unit/test_fp8_auto_table.py and test_auto_measure.py cover the other sources)."""
    def set_capability(major, minor, name=None):
        name = name or ("NVIDIA H200" if (major, minor) == (9, 0) else f"Test GPU sm_{major}{minor}")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return set_capability


def _symint(hint: int | None):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    if hint is None:
        return env.create_unbacked_symint()
    return env.create_symintnode(env.create_symbol(hint, ConstantSource("m"), dynamic_dim=DimDynamic.DYNAMIC),
                                 hint=hint)


def test_cpu_gets_emulated_mxfp8():
    recipe, reason = auto.choose_recipe("cpu", "linear", 16384, 2048, 3072)
    assert recipe == "mxfp8" and "CPU" in reason and "emulated" in reason


def test_sm100_gets_mxfp8(cuda_capability):
    cuda_capability(10, 0)
    for kind in ("linear", "grouped"):
        recipe, reason = auto.choose_recipe("cuda", kind, 16384, 2048, 1408, experts=16)
        assert recipe == "mxfp8" and "sm_100" in reason


def test_sm90_large_gemms_get_fp8_rowwise_from_the_table_or_the_size_rule(cuda_capability):
    cuda_capability(9, 0)
    recipe, reason = auto.choose_recipe("cuda", "linear", 32768, 2048, 3072)  # 16B wq: in the table
    assert recipe == "fp8_rowwise" and "sm_90" in reason and "at M=32768" in reason
    assert auto_table.SHIPPED.name in reason
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 4096, 4096)  # not in it: the size rule
    assert recipe == "fp8_rowwise" and "M=16384" in reason and auto.THRESHOLDS_SOURCE in reason


def test_sm90_grouped_gemms_outside_the_table_take_fp8_only_at_the_rules_load(cuda_capability, monkeypatch):
    cuda_capability(9, 0)
    need = auto.FP8_ROWWISE_MIN["grouped"]
    per_expert = math.ceil(need.work / (4096 * 3072))  # the work per expert group decides, not tokens alone
    recipe, reason = auto.choose_recipe("cuda", "grouped", per_expert * 16, 4096, 3072, experts=16)
    assert recipe == "fp8_rowwise" and auto.THRESHOLDS_SOURCE in reason
    recipe, reason = auto.choose_recipe("cuda", "grouped", per_expert * 8, 4096, 3072, experts=16)
    assert recipe == "bf16" and f"tokens per expert*K*N={per_expert // 2 * 4096 * 3072:.3g}" in reason, reason
    recipe, reason = auto.choose_recipe("cuda", "grouped", (need.tokens - 1) * 16, 65536, 65536, experts=16)
    assert recipe == "bf16" and f"tokens per expert={need.tokens - 1} < {need.tokens}" in reason
    monkeypatch.setitem(auto.FP8_ROWWISE_MIN, "grouped", None)  # a GPU where FP8 never won
    recipe, reason = auto.choose_recipe("cuda", "grouped", per_expert * 16, 4096, 3072, experts=16)
    assert recipe == "bf16" and "slower than BF16" in reason and auto.THRESHOLDS_SOURCE in reason


def test_sm90_expert_gemms_of_a_measured_mlp_follow_its_table_rows(cuda_capability):
    cuda_capability(9, 0)
    # 671B dims: the expert MLP won from 2048 tokens per expert; 16B dims lost at every load measured
    for k, n in ((7168, 2048), (2048, 7168)):
        assert auto.choose_recipe("cuda", "grouped", 2048 * 64, k, n, experts=64)[0] == "fp8_rowwise"
        recipe, reason = auto.choose_recipe("cuda", "grouped", 1024 * 64, k, n, experts=64)
        assert recipe == "bf16" and "expert MLP dim=7168 inter=2048" in reason, reason
    recipe, reason = auto.choose_recipe("cuda", "grouped", 3072 * 64, 2048, 1408, experts=64)
    assert recipe == "bf16" and "interpolated" in reason and "does not pay" in reason


def test_sm90_grouped_gemms_with_unknown_tokens_stay_bf16(cuda_capability):
    cuda_capability(9, 0)
    for m in (None, _Unbacked()):
        recipe, reason = auto.choose_recipe("cuda", "grouped", m, 2048, 1408, experts=16)
        assert recipe == "bf16" and "tokens per expert unknown at compile time" in reason, reason


class _Unbacked:
    """A SymInt stand-in with no hint, as a data-dependent token count after an EP dispatch has."""

    class node:
        hint = None


def test_wgrad_bf16_auto_puts_grouped_and_linear_wgrads_in_fp8():
    assert FP8_ROWWISE.choose_wgrad_bf16("auto", "grouped") == (False, "wgrad FP8")
    assert FP8_ROWWISE.choose_wgrad_bf16("auto", "linear") == (False, "wgrad FP8")
    for kind in ("linear", "grouped"):
        assert FP8_ROWWISE.choose_wgrad_bf16(False, kind) == (False, "wgrad FP8: fp8_rowwise.wgrad_bf16=False requested")
        assert FP8_ROWWISE.choose_wgrad_bf16(True, kind)[0] is True


def test_sm90_small_gemms_stay_bf16_saying_why(cuda_capability):
    cuda_capability(9, 0)
    need = auto.FP8_ROWWISE_MIN["linear"]  # shapes the table does not hold: the size rule
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 4096, need.n // 2)
    assert recipe == "bf16" and reason.startswith("left in BF16: too small for FP8 to win")
    assert f"N={need.n // 2} < {need.n}" in reason and f"M*K*N={16384 * 4096 * (need.n // 2):.3g}" in reason
    recipe, reason = auto.choose_recipe("cuda", "linear", need.tokens // 2, 4096, 4096)
    assert recipe == "bf16" and f"tokens={need.tokens // 2}" in reason
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, need.k // 2, 4096)
    assert recipe == "bf16" and f"K={need.k // 2} < {need.k}" in reason
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 3072, 3072)
    assert recipe == "bf16" and f"K*N={3072 * 3072:.3g} < {need.work:.3g}" in reason
    # a shape the table holds: its measurement decides (16B attention.wo lost at M=16384)
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 2048, 2048)
    assert recipe == "bf16" and "does not pay" in reason and "at M=16384" in reason
    assert auto.choose_recipe("cuda", "linear", 16384, 7168, 1536)[0] == "fp8_rowwise"  # 671B wq_a: 1.06x
    assert auto.choose_recipe("cuda", "linear", 8192, 7168, 1536)[0] == "bf16"  # 0.99x at 8192


def test_sm90_decides_on_k_and_n_when_m_is_unknown_and_says_so(cuda_capability):
    cuda_capability(9, 0)
    recipe, reason = auto.choose_recipe("cuda", "linear", _symint(None), 4096, 4096)
    assert recipe == "fp8_rowwise" and "unknown at compile time" in reason
    recipe, reason = auto.choose_recipe("cuda", "linear", _symint(32768), 2048, 3072)
    assert recipe == "fp8_rowwise" and "example M=32768" in reason
    recipe, reason = auto.choose_recipe("cuda", "linear", _symint(64), 2048, 3072)
    assert recipe == "bf16" and "below the smallest measured" in reason  # the example M decides when there is one
    recipe, _ = auto.choose_recipe("cuda", "grouped", None, 2048, 512, experts=8)
    assert recipe == "bf16"


def test_sm89_has_fp8_linears_but_no_fp8_grouped_gemm(cuda_capability):
    cuda_capability(8, 9)
    assert auto.choose_recipe("cuda", "linear", 16384, 4096, 4096)[0] == "fp8_rowwise"
    recipe, reason = auto.choose_recipe("cuda", "grouped", 16384, 4096, 4096, experts=8)
    assert recipe == "bf16" and "sm_90" in reason
    kernel, reason = choose_fp8_rowwise_kernel(torch.device("cuda"), grouped=True)
    assert kernel == "emulated" and "sm_89" in reason


def test_sm80_stays_bf16(cuda_capability):
    cuda_capability(8, 0)
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 4096, 4096)
    assert recipe == "bf16" and "no FP8 tensor cores" in reason


def test_explicit_recipe_is_honoured_and_bad_names_rejected():
    assert resolve_recipe("fp8_rowwise", "cpu", "linear", 8, 16, 16) == (
        "fp8_rowwise", "recipe='fp8_rowwise' requested")
    assert resolve_recipe("auto", "cpu", "grouped", 8, 64, 64, experts=2)[0] == "mxfp8"
    with pytest.raises(OptionsError, match=r"'auto', 'mxfp8', 'fp8_rowwise'"):
        resolve_recipe("fp8", "cpu", "linear", 8, 16, 16)


def test_shape_rules_per_recipe():
    assert RECIPES["fp8_rowwise"].shape_problem(48, 16) is None
    problem = RECIPES["fp8_rowwise"].shape_problem(40, 16)
    assert (problem.code, problem.text) == (SkipCode.NOT_A_MULTIPLE, "fp8_rowwise: K=40 not a multiple of 16")
    assert RECIPES["mxfp8"].shape_problem(48, 64).text == "mxfp8: K=48 not a multiple of 32"
    problem = RECIPES["mxfp8"].shape_problem(0, 64)
    assert (problem.code, problem.text) == (SkipCode.EMPTY_GEMM, "mxfp8: empty GEMM (K=0, N=64): nothing to quantize")


def test_fp8_rowwise_kernel_option(cuda_capability, monkeypatch):
    assert FP8_ROWWISE.choose_kernel("auto", "cpu", "grouped")[0] == "emulated"
    with pytest.raises(OptionsError, match=r"fp8_rowwise.kernel='scaled_mm' requested but CPU"):
        FP8_ROWWISE.choose_kernel("scaled_mm", "cpu", "linear")
    cuda_capability(9, 0)
    monkeypatch.setattr("moepass.ops.lowp.fp8_rowwise.kernels.choice._triton_available", lambda: True)
    kernel, reason = FP8_ROWWISE.choose_kernel("auto", "cuda", "grouped")
    assert kernel == "scaled_mm" and "torch._scaled_grouped_mm" in reason and "sm_90" in reason
    kernel, reason = FP8_ROWWISE.choose_kernel("emulated", "cuda", "linear")
    assert kernel == "emulated" and "fp8_rowwise.kernel='emulated' requested" in reason
    monkeypatch.setattr("moepass.ops.lowp.fp8_rowwise.kernels.choice._triton_available", lambda: False)
    kernel, reason = FP8_ROWWISE.choose_kernel("auto", "cuda", "linear")
    assert kernel == "emulated" and "Triton is unavailable" in reason


# ---- the passes under recipe="fp8_rowwise" ------------------------------------------------------------


def test_debug_model_under_fp8_rowwise_rewrites_every_gemm_and_reports_why():
    import moepass
    from moepass.models import build_model
    from moepass.harness.train import next_token_loss

    torch.manual_seed(0)
    model = build_model("debug")
    tokens = torch.randint(0, 2048, (2, 64))
    with moepass.collecting() as report:
        # every GEMM quantized, the grouped wgrad too (stated, though "auto" now says the same)
        compiled = torch.compile(model, backend="moepass", options={"recipe": "fp8_rowwise", "inductor": False,
                                                                    "fp8_rowwise.wgrad_bf16": False})
        loss = next_token_loss(compiled(tokens), tokens)
    with OpsCalled() as backward_ops:
        loss.backward()
    passes = {p["name"]: p for p in report.to_dict()["passes"]}
    grouped, linear = passes["grouped_mm"], passes["linear"]
    assert grouped["replaced"] == 9 and grouped["skipped"] == []
    assert {r["op"] for r in grouped["rewrites"] + linear["rewrites"]} == {
        "moepass.fp8_rowwise_grouped_mm", "moepass.fp8_rowwise_linear"}
    assert all("recipe=fp8_rowwise kernel=emulated: recipe='fp8_rowwise' requested" in r["detail"]
               for r in linear["rewrites"])
    # the routed experts' wgrad reads the FP8 token rows quantize_once saved (ops/lowp/grouped_mm_rows.py)
    for op in ("fp8_rowwise_linear_dgrad", "fp8_rowwise_linear_wgrad", "fp8_rowwise_grouped_mm_dgrad",
               "fp8_rowwise_grouped_mm_wgrad_on_rows"):
        assert f"moepass::{op}" in backward_ops.names, (op, sorted(backward_ops.names))
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.extended  # ~3-5 min on 2 cores: pytest -m extended
def test_debug_model_loss_after_50_steps_within_3_percent_of_bf16():
    import copy

    from moepass.harness.corpus import Batches, load_corpus
    from moepass.models import build_model
    from moepass.harness.train import train

    torch.manual_seed(0)
    base = build_model("debug")
    train_tokens, _ = load_corpus(limit_bytes=1 << 20)
    batches = Batches(train_tokens, batch_size=2, seq_len=64, seed=0)
    final = {}
    for name, backend, options in (("bf16", "inductor", None), ("fp8_rowwise", "moepass", {"recipe": "fp8_rowwise"})):
        model = copy.deepcopy(base)
        kwargs = {"options": options} if options else {}
        results = train(model, torch.compile(model, backend=backend, **kwargs), batches, 50, torch.device("cpu"),
                        lr=3e-3)
        assert all(math.isfinite(r.loss) for r in results)
        final[name] = sum(r.loss for r in results[-5:]) / 5
    assert final["bf16"] < 6.0, f"BF16 baseline did not learn: {final}"
    assert abs(final["fp8_rowwise"] - final["bf16"]) / final["bf16"] <= 0.03, final


def test_sm90_at_671b_dims_with_8192_tokens_per_rank_rewrites_the_linears_the_table_says_pay(cuda_capability):
    """EP=2 at 8,192 tokens per rank: the old single 16,384-token floor left every linear BF16."""
    cuda_capability(9, 0)
    shapes = {"attention.wq_a": (7168, 1536), "attention.wq_b": (1536, 24576), "attention.wkv_a": (7168, 576),
              "attention.wkv_b": (512, 32768), "attention.wo": (16384, 7168), "shared_experts.w1": (7168, 2048),
              "shared_experts.w2": (2048, 7168), "dense_ffn.w1": (7168, 18432), "dense_ffn.w2": (18432, 7168)}
    picks = {name: auto.choose_recipe("cuda", "linear", 8192, k, n)[0] for name, (k, n) in shapes.items()}
    assert {name for name, recipe in picks.items() if recipe == "fp8_rowwise"} == {
        "attention.wq_b", "attention.wo", "shared_experts.w1", "shared_experts.w2", "dense_ffn.w1", "dense_ffn.w2"}
