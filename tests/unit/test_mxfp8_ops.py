"""moepass::mxfp8_* custom ops on CPU: torchao-equal numerics, accuracy, padding, bias, opcheck, compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import moepass.ops  # noqa: F401  (registers torch.ops.moepass.*)
from moepass.ops.lowp.mxfp8.kernels.choice import choose_mxfp8_kernel
from helpers import MXFP8_GROUPED_SHAPES as GROUPED_SHAPES
from helpers import MXFP8_LINEAR_SHAPES as LINEAR_SHAPES
from helpers import MXFP8_SQNR_BARS as SQNR_BARS
from helpers import (assert_all_equal, assert_sqnr, block_inputs, call_targets, forward_backward, grouped_inputs,
                     grouped_reference, linear_inputs, linear_reference, recording_backend, sqnr, torchao_grouped,
                     torchao_linear)
from helpers import mxfp8_op_grouped as op_grouped
from helpers import mxfp8_op_linear as op_linear

ops = torch.ops.moepass
BF16 = torch.bfloat16


# ---- schemas -----------------------------------------------------------------------------------

def test_op_schemas_are_the_published_contract():
    want = {
        "mxfp8_linear": "Tensor x, Tensor weight, Tensor? bias, str scale_rounding, bool wgrad_bf16, str kernel",
        "mxfp8_linear_dgrad": "Tensor grad_out, Tensor weight, str scale_rounding, str kernel",
        "mxfp8_linear_wgrad": "Tensor grad_out, Tensor x, str scale_rounding, str kernel",
        "mxfp8_grouped_mm": "Tensor x, Tensor w_t, Tensor offs, str scale_rounding, bool wgrad_bf16, str kernel",
        "mxfp8_grouped_mm_dgrad": "Tensor grad_out, Tensor w_t, Tensor offs, str scale_rounding, str kernel",
        "mxfp8_grouped_mm_wgrad": "Tensor grad_out, Tensor x, Tensor offs, str scale_rounding, str kernel",
    }
    for name, args in want.items():
        assert str(getattr(ops, name).default._schema) == f"moepass::{name}({args}) -> Tensor"


def test_cpu_chooses_emulated_with_a_reason():
    kernel, reason = choose_mxfp8_kernel(torch.device("cpu"))
    assert kernel == "emulated" and "CPU" in reason and "emulated" in reason


# ---- bit for bit against torchao's emulated MXFP8 -----------------------------------------------

@pytest.mark.parametrize("scale_rounding", ["rceil", "floor"])
@pytest.mark.parametrize("x_shape, n", [((64, 64), 96), ((2, 32, 128), 64)])
def test_linear_equals_torchao_emulated(scale_rounding, x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=len(x_shape) * 7 + n)
    assert_all_equal(op_linear(x, w, g, scale_rounding), torchao_linear(x, w, g, scale_rounding))


def test_linear_wgrad_bf16_equals_torchao_wgrad_with_hp():
    x, w, g = linear_inputs((64, 96), 64, seed=3)
    assert_all_equal(op_linear(x, w, g, wgrad_bf16=True), torchao_linear(x, w, g, wgrad_bf16=True))


@pytest.mark.parametrize("scale_rounding", ["rceil", "floor"])
@pytest.mark.parametrize("group_sizes", [[10, 0, 50, 40], [32, 64, 0, 1], [64, 32]])
def test_grouped_equals_torchao_emulated(scale_rounding, group_sizes):
    x, w_t, offs, g = grouped_inputs(group_sizes, 64, 96, seed=sum(group_sizes))
    got = op_grouped(x, w_t, offs, g, scale_rounding)
    assert_all_equal(got, torchao_grouped(x, w_t, offs, g, scale_rounding))
    assert got[2].shape == w_t.shape


def test_linear_tokens_not_multiple_of_32_equal_torchao_on_zero_padded_tokens():
    """wgrad pads tokens with zero rows: same result as torchao given those zero rows explicitly."""
    x, w, g = linear_inputs((50, 64), 32, seed=11)
    pad = lambda t: F.pad(t, (0, 0, 0, 14))  # noqa: E731
    want = torchao_linear(pad(x), w, pad(g))
    out, grad_x, grad_w = op_linear(x, w, g)
    assert_all_equal((out, grad_x, grad_w), (want[0][:50], want[1][:50], want[2]))


# ---- accuracy against an fp32 reference of the bf16 inputs ----------------------------------------


@pytest.mark.parametrize("scale_rounding", ["rceil", "floor"])
@pytest.mark.parametrize("case", range(len(LINEAR_SHAPES)))
def test_linear_sqnr(scale_rounding, case):
    x_shape, n = LINEAR_SHAPES[case]
    x, w, g = linear_inputs(x_shape, n, seed=100 + case)
    assert_sqnr(linear_reference(x, w, g), op_linear(x, w, g, scale_rounding), SQNR_BARS[scale_rounding],
                f"linear {x_shape} N={n} {scale_rounding}")


@pytest.mark.parametrize("scale_rounding", ["rceil", "floor"])
@pytest.mark.parametrize("case", range(len(GROUPED_SHAPES)))
def test_grouped_sqnr(scale_rounding, case):
    sizes, k, n = GROUPED_SHAPES[case]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=200 + case)
    assert_sqnr(grouped_reference(x, w_t, offs, g), op_grouped(x, w_t, offs, g, scale_rounding),
                SQNR_BARS[scale_rounding], f"grouped {sizes} K={k} N={n} {scale_rounding}")


def test_wgrad_bf16_is_clearly_more_accurate_than_mxfp8_wgrad():
    x, w, g = linear_inputs((50, 128), 64, seed=300)
    ref = linear_reference(x, w, g)[2]
    assert sqnr(ref, op_linear(x, w, g, wgrad_bf16=True)[2]) > sqnr(ref, op_linear(x, w, g)[2]) + 15
    x, w_t, offs, g = grouped_inputs([33, 0, 31, 70], 128, 64, seed=301)
    ref = grouped_reference(x, w_t, offs, g)[2]
    assert sqnr(ref, op_grouped(x, w_t, offs, g, wgrad_bf16=True)[2]) > sqnr(ref, op_grouped(x, w_t, offs, g)[2]) + 15


# ---- padding never leaks ------------------------------------------------------------------------

@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_tokens_after_last_group_give_zeros_and_do_not_touch_grads(wgrad_bf16):
    x, w_t, offs, g = grouped_inputs([10, 0, 45], 64, 64, seed=400, trailing_tokens=23)
    inside = int(offs[-1])
    x[inside:], g[inside:] = 1e4, 1e4  # loud values: any leak would show
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g, wgrad_bf16=wgrad_bf16)
    assert not out[inside:].any() and not grad_x[inside:].any()
    want = op_grouped(x[:inside], w_t, offs, g[:inside], wgrad_bf16=wgrad_bf16)
    assert_all_equal((out[:inside], grad_x[:inside], grad_w_t), want)


def test_empty_group_gets_exactly_zero_weight_grad():
    x, w_t, offs, g = grouped_inputs([40, 0, 30], 64, 64, seed=401)
    for wgrad_bf16 in (False, True):
        assert not op_grouped(x, w_t, offs, g, wgrad_bf16=wgrad_bf16)[2][1].any()


def test_padded_groups_match_reference_per_group():
    """Each group alone, not just the whole tensor, clears the SQNR bars (padding rows add nothing)."""
    x, w_t, offs, g = grouped_inputs([33, 1, 63], 64, 96, seed=402)
    got, ref = op_grouped(x, w_t, offs, g), grouped_reference(x, w_t, offs, g)
    start = 0
    for e, end in enumerate(offs.tolist()):
        rows = slice(start, end)
        assert_sqnr((ref[0][rows], ref[1][rows], ref[2][e]), (got[0][rows], got[1][rows], got[2][e]),
                    SQNR_BARS["rceil"], f"group {e}")
        start = end


# ---- bias ---------------------------------------------------------------------------------------

def test_bias_is_added_after_the_gemm_and_its_grad_is_the_token_sum():
    x, w, g = linear_inputs((2, 40, 64), 96, seed=500)
    bias = torch.randn(96).to(BF16)
    out_b, grad_x_b, grad_w_b, grad_b = forward_backward(
        lambda a, b, c: ops.mxfp8_linear(a, b, c, "rceil", False, "emulated"), g, x, w, bias)
    out, grad_x, grad_w = op_linear(x, w, g)
    # Exact: one bf16 add of the bias onto the bf16 GEMM result; bias never changes x or W grads.
    assert torch.equal(out_b, out + bias)
    assert torch.equal(grad_x_b, grad_x) and torch.equal(grad_w_b, grad_w)
    # grad_bias: fp32 accumulation over all tokens, rounded once to bf16.
    token_sum = g.reshape(-1, 96).double().sum(0)
    assert torch.equal(grad_b, g.reshape(-1, 96).float().sum(0).to(BF16))
    assert torch.allclose(grad_b.double(), token_sum, rtol=2**-8, atol=0)


# ---- opcheck --------------------------------------------------------------------------------------

def _opcheck_cases():
    x, w, g = linear_inputs((2, 20, 64), 32, seed=600)
    xg, w_t, offs, gg = grouped_inputs([5, 0, 27], 64, 32, seed=601, trailing_tokens=3)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    return {
        "linear": (ops.mxfp8_linear, (leaf(x), leaf(w), leaf(torch.randn(32).to(BF16)), "rceil", False, "emulated")),
        "linear_wgrad_bf16": (ops.mxfp8_linear, (leaf(x), leaf(w), None, "floor", True, "emulated")),
        "linear_dgrad": (ops.mxfp8_linear_dgrad, (g, w, "rceil", "emulated")),
        "linear_wgrad": (ops.mxfp8_linear_wgrad, (g, x, "floor", "emulated")),
        "grouped": (ops.mxfp8_grouped_mm, (leaf(xg), leaf(w_t), offs, "rceil", False, "emulated")),
        "grouped_wgrad_bf16": (ops.mxfp8_grouped_mm, (leaf(xg), leaf(w_t), offs, "rceil", True, "emulated")),
        "grouped_dgrad": (ops.mxfp8_grouped_mm_dgrad, (gg, w_t, offs, "rceil", "emulated")),
        "grouped_wgrad": (ops.mxfp8_grouped_mm_wgrad, (gg, xg, offs, "floor", "emulated")),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op.default, args)


# ---- torch.compile ---------------------------------------------------------------------------------

def _moe_block(x, w, bias, w_t, offs, wgrad_bf16):
    h = ops.mxfp8_linear(x, w, bias, "rceil", wgrad_bf16, "emulated")
    return ops.mxfp8_grouped_mm(h.reshape(-1, h.shape[-1]), w_t, offs, "rceil", wgrad_bf16, "emulated")


@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_aot_backward_graph_holds_the_quantized_backward_ops(wgrad_bf16):
    x, w, bias, w_t, offs, g = block_inputs(seed=700)
    graphs = {}
    compiled = torch.compile(lambda *a: _moe_block(*a, wgrad_bf16), backend=recording_backend(graphs), fullgraph=True)
    forward_backward(compiled, g, x, w, bias, w_t, offs)
    assert {ops.mxfp8_linear.default, ops.mxfp8_grouped_mm.default} <= call_targets(graphs["fw"])
    bw = call_targets(graphs["bw"])
    assert {ops.mxfp8_linear_dgrad.default, ops.mxfp8_grouped_mm_dgrad.default} <= bw
    wgrads = {ops.mxfp8_linear_wgrad.default, ops.mxfp8_grouped_mm_wgrad.default}
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

    fn = torch.compile(lambda x, w: ops.mxfp8_linear(x, w, None, "rceil", False, "emulated"), backend=backend,
                       dynamic=True)
    for m in (40, 72, 17):
        x, w, _ = linear_inputs((m, 64), 32, seed=m)
        assert torch.equal(fn(x, w), ops.mxfp8_linear(x, w, None, "rceil", False, "emulated"))
    assert len(counts) == 1


# ---- bad inputs ----------------------------------------------------------------------------------

def test_rejects_non_bf16_naming_the_dtype():
    x, w, g = linear_inputs((32, 64), 32, seed=900)
    with pytest.raises(ValueError, match=r"torch\.float32.*bf16"):
        ops.mxfp8_linear(x.float(), w, None, "rceil", False, "emulated")
    xg, w_t, offs, _ = grouped_inputs([32], 64, 32, seed=901)
    with pytest.raises(ValueError, match=r"torch\.float16.*bf16"):
        ops.mxfp8_grouped_mm(xg, w_t.half(), offs, "rceil", False, "emulated")


def test_rejects_dims_not_multiple_of_32_naming_the_fix():
    x, w, _ = linear_inputs((32, 48), 32, seed=902)
    with pytest.raises(ValueError, match=r"K=48 is not a multiple of 32.*pad K"):
        ops.mxfp8_linear(x, w, None, "rceil", False, "emulated")
    x, w, _ = linear_inputs((32, 64), 40, seed=903)
    with pytest.raises(ValueError, match=r"N=40 is not a multiple of 32"):
        ops.mxfp8_linear(x, w, None, "rceil", False, "emulated")
    xg, w_t, offs, _ = grouped_inputs([32], 48, 32, seed=904)
    with pytest.raises(ValueError, match=r"K=48 is not a multiple of 32"):
        ops.mxfp8_grouped_mm(xg, w_t, offs, "rceil", False, "emulated")


def test_rejects_bad_strings_naming_the_valid_values():
    x, w, _ = linear_inputs((32, 64), 32, seed=905)
    with pytest.raises(ValueError, match=r"'rceil', 'floor'"):
        ops.mxfp8_linear(x, w, None, "even", False, "emulated")
    with pytest.raises(ValueError, match=r"'emulated', 'sm100'"):
        ops.mxfp8_linear(x, w, None, "rceil", False, "cuda")


def test_rejects_bad_offs():
    xg, w_t, offs, _ = grouped_inputs([16, 16], 64, 32, seed=906)
    with pytest.raises(ValueError, match=r"offs must be int32"):
        ops.mxfp8_grouped_mm(xg, w_t, offs.long(), "rceil", False, "emulated")
    with pytest.raises(ValueError, match=r"offs must be int32 \[E\].*E=2"):
        ops.mxfp8_grouped_mm(xg, w_t, offs[:1], "rceil", False, "emulated")


def test_sm100_kernel_on_cpu_raises_and_points_to_emulated():
    x, w, _ = linear_inputs((32, 64), 32, seed=907)
    with pytest.raises(RuntimeError, match=r"kernel='sm100' cannot run here: CPU.*kernel='emulated'"):
        ops.mxfp8_linear(x, w, None, "rceil", False, "sm100")


def test_fake_impls_check_arguments_at_trace_time():
    with FakeTensorMode():
        x, w = torch.empty(32, 48, dtype=BF16), torch.empty(32, 48, dtype=BF16)
        with pytest.raises(ValueError, match=r"K=48"):
            ops.mxfp8_linear(x, w, None, "rceil", False, "emulated")
        out = ops.mxfp8_grouped_mm(torch.empty(10, 64, dtype=BF16), torch.empty(3, 64, 32, dtype=BF16),
                                   torch.empty(3, dtype=torch.int32), "floor", True, "emulated")
        assert out.shape == (10, 32) and out.dtype == BF16
