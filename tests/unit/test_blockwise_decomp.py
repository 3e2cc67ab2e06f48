"""moepass/ops/lowp/blockwise/decomp.py on CPU: the blockwise ops' "scaled_mm" kernel decomposed for Inductor into
plain-torch quantization around the opaque GEMM ops moepass::blockwise_scaled_mm / blockwise_scaled_grouped_mm.

Kernel "scaled_mm" is allowed on CPU here (the blockwise_scaled_mm_on_cpu fixture), where the opaque GEMM ops run the
emulated GEMM: so the decomposed graphs, traced by AOTAutograd and compiled by Inductor, are compared bit for bit
with kernel "emulated" run eagerly (same quantization code, same GEMM). GPU counterpart: tests/gpu/test_blockwise_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import moepass
import moepass.ops  # noqa: F401  (registers the ops)
from moepass.ops.lowp.blockwise import decomp, quant
from moepass.ops.lowp.blockwise.kernels import choice, gemm
from moepass.ops.lowp.blockwise.recipe import BLOCKWISE
from moepass.options import Config
from moepass.recipes.registry import settle
from helpers import (assert_all_equal, compile_caches_off, forward_backward, grouped_inputs, linear_inputs,
                     recording_aot_backend, two_linears_per_kernel)

ops = torch.ops.moepass
BF16 = torch.bfloat16
BLOCKWISE_OPS = {getattr(ops, f"blockwise_{name}").default for name in (
    "linear", "linear_dgrad", "linear_wgrad", "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad")}
GEMM_OPS = {ops.blockwise_scaled_mm.default, ops.blockwise_scaled_grouped_mm.default}


@pytest.fixture
def blockwise_scaled_mm_on_cpu(monkeypatch):
    """Let kernels "scaled_mm" and "triton" pass the blockwise ops' checks on CPU (their opaque GEMM ops emulate
    there)."""
    original_problem, original_choice = choice.kernel_problem, choice.choose_blockwise_kernel

    def problem(kernel, device, grouped):
        if kernel in decomp.DECOMPOSED and torch.device(device).type == "cpu":
            return None
        return original_problem(kernel, device, grouped)

    def choose(device, grouped):
        if torch.device(device).type == "cpu":
            return "scaled_mm", "test: blockwise scaled_mm on CPU (emulated GEMM)"
        return original_choice(device, grouped)

    monkeypatch.setattr(choice, "kernel_problem", problem)
    monkeypatch.setattr(choice, "choose_blockwise_kernel", choose)


def _graphs_backend(graphs, compiles=None):
    return recording_aot_backend(graphs, decomp.blockwise_decompositions(BLOCKWISE), compiles)


def _linear(kernel, wgrad_bf16=False):
    return lambda x, w: ops.blockwise_linear(x, w, None, wgrad_bf16, kernel)


def _grouped(offs, kernel, wgrad_bf16=False):
    return lambda x, w_t: ops.blockwise_grouped_mm(x, w_t, offs, wgrad_bf16, kernel)


# ---- the table ----------------------------------------------------------------------------------

def test_the_recipe_hands_inductor_a_table_of_its_six_ops():
    table = BLOCKWISE.decompositions(settle(Config.from_options({}), weights_sharded=False))
    rows_form = {ops.blockwise_quantize_rows.default, ops.blockwise_grouped_mm_rows.default,
                 ops.blockwise_grouped_mm_on_rows.default}  # quantize_once's ops (tests/integration/test_quantize_once.py)
    assert set(table) == BLOCKWISE_OPS | rows_form


def test_emulated_and_deepgemm_kernels_are_not_decomposed():
    x, w, g = linear_inputs((32, 128), 128, seed=1)
    xg, w_t, offs, gg = grouped_inputs([10, 22], 128, 128, seed=2)
    table = decomp.blockwise_decompositions(BLOCKWISE)
    for kernel in ("emulated", "deepgemm"):
        calls = {ops.blockwise_linear.default: (x, w, None, False, kernel),
                 ops.blockwise_linear_dgrad.default: (g, w, kernel),
                 ops.blockwise_linear_wgrad.default: (g, x, kernel),
                 ops.blockwise_grouped_mm.default: (xg, w_t, offs, False, kernel),
                 ops.blockwise_grouped_mm_dgrad.default: (gg, w_t, offs, kernel),
                 ops.blockwise_grouped_mm_wgrad.default: (gg, xg, offs, kernel)}
        for op, args in calls.items():
            assert table[op](*args) is NotImplemented, (op, kernel)


def test_scales_are_amax_times_the_fp32_reciprocal_of_448():
    """The product Inductor's Triton code computes for a division by a constant (quant.py): eager equals it."""
    t = torch.randn(4, 256).to(BF16)
    _, scale = quant.quantize_tiles(t)
    amax = t.float().reshape(4, 2, 128).abs().amax(-1)
    assert torch.equal(scale, amax * torch.tensor(1 / 448, dtype=torch.float32))


# ---- the opaque GEMM ops ---------------------------------------------------------------------------

def _gemm_op_cases():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, 256, generator=gen).to(BF16), torch.randn(128, 256, generator=gen).to(BF16)
    a_q, a_s = quant.quantize_tiles(a)
    bb_q, bb_s = quant.quantize_blocks(b)
    bt_q, bt_s = quant.quantize_tiles(b)
    w_q, w_s = quant.quantize_blocks(torch.randn(3, 128, 256, generator=gen).to(BF16))
    offs = torch.tensor([10, 10, 33], dtype=torch.int32)
    p_q, p_s = quant.quantize_tiles(torch.randn(128, 384, generator=gen).to(BF16))  # [N, P]: 3 token tiles
    k_q, k_s = quant.quantize_tiles(torch.randn(256, 384, generator=gen).to(BF16))  # [K, P]
    padded_ends = torch.tensor([128, 128, 384], dtype=torch.int32)
    return {
        "mm_blocks": (ops.blockwise_scaled_mm, (a_q, a_s, bb_q, bb_s, True), (a_q, a_s, bb_q, bb_s, True)),
        "mm_tiles": (ops.blockwise_scaled_mm, (a_q, a_s, bt_q, bt_s, False), (a_q, a_s, bt_q, bt_s, False)),
        "grouped": (ops.blockwise_scaled_grouped_mm, (a_q, a_s, w_q, w_s, offs), None),
        "grouped_wgrad": (ops.blockwise_scaled_grouped_mm, (p_q, p_s, k_q, k_s, padded_ends), None),
        "triton_grouped": (ops.blockwise_triton_grouped_mm, (a_q, a_s, w_q, w_s, offs), None),
        "triton_grouped_wgrad": (ops.blockwise_triton_grouped_mm, (p_q, p_s, k_q, k_s, padded_ends), None),
    }


@pytest.mark.parametrize("name", list(_gemm_op_cases()))
def test_gemm_ops_opcheck_and_emulate_on_cpu(name):
    op, args, emulated_args = _gemm_op_cases()[name]
    # test_schema compares e4m3 inputs arithmetically, which CPU torch lacks for float8
    torch.library.opcheck(op.default, args, test_utils=("test_faketensor", "test_autograd_registration",
                                                        "test_aot_dispatch_dynamic"))
    if emulated_args is not None:
        assert torch.equal(op(*args), gemm.emulated_mm_nt(*emulated_args))


@pytest.mark.parametrize("form", ["", "triton_"])
def test_grouped_gemm_op_zeroes_rows_after_the_last_group_and_empty_groups(form):
    op, (a_q, a_s, w_q, w_s, offs), _ = _gemm_op_cases()[f"{form}grouped"]
    out = op(a_q, a_s, w_q, w_s, offs)
    assert out.shape == (40, 128) and not out[33:].any() and out[:33].any()
    _, (p_q, p_s, k_q, k_s, ends), _ = _gemm_op_cases()[f"{form}grouped_wgrad"]
    grad_w = op(p_q, p_s, k_q, k_s, ends)
    assert grad_w.shape == (3, 128, 256) and not grad_w[1].any() and grad_w[0].any()


# ---- kernel "scaled_mm" on CPU: the decomposed code, eagerly, equals "emulated" bit for bit ---------------

LINEAR_CASES = [((64, 128), 256), ((2, 25, 256), 128), ((7, 384), 128), ((0, 128), 128)]
GROUPED_CASES = [([10, 0, 50, 40], 0), ([33, 31, 1, 0], 7), ([130], 3)]


@pytest.mark.parametrize("x_shape, n", LINEAR_CASES)
def test_linear_decomposition_equals_emulated_bit_for_bit(blockwise_scaled_mm_on_cpu, x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=sum(x_shape) + n)
    want = forward_backward(_linear("emulated"), g, x, w)
    assert_all_equal(forward_backward(_linear("scaled_mm"), g, x, w), want, f"eager op {x_shape}")
    table = decomp.blockwise_decompositions(BLOCKWISE)
    direct = (table[ops.blockwise_linear.default](x, w, None, False, "scaled_mm"),
              table[ops.blockwise_linear_dgrad.default](g, w, "scaled_mm"),
              table[ops.blockwise_linear_wgrad.default](g, x, "scaled_mm"))
    assert_all_equal(direct, want, f"decomposition {x_shape}")


@pytest.mark.parametrize("kernel", decomp.DECOMPOSED)
@pytest.mark.parametrize("sizes, trailing", GROUPED_CASES)
def test_grouped_decomposition_equals_emulated_bit_for_bit(blockwise_scaled_mm_on_cpu, sizes, trailing, kernel):
    x, w_t, offs, g = grouped_inputs(sizes, 128, 256, seed=sum(sizes), trailing_tokens=trailing)
    want = forward_backward(_grouped(offs, "emulated"), g, x, w_t)
    assert_all_equal(forward_backward(_grouped(offs, kernel), g, x, w_t), want, f"eager op {sizes}")
    table = decomp.blockwise_decompositions(BLOCKWISE)
    direct = (table[ops.blockwise_grouped_mm.default](x, w_t, offs, False, kernel),
              table[ops.blockwise_grouped_mm_dgrad.default](g, w_t, offs, kernel),
              table[ops.blockwise_grouped_mm_wgrad.default](g, x, offs, kernel))
    assert_all_equal(direct, want, f"decomposition {sizes}")


def test_rows_form_decomposition_equals_emulated_bit_for_bit(blockwise_scaled_mm_on_cpu):
    """quantize_once's ops (ops/lowp/grouped_mm_rows.py) for kernel "scaled_mm": the rows' quantization in plain torch
    and the GEMM on quantized rows, bit-equal to the emulated ops."""
    x, w_t, offs, _ = grouped_inputs([20, 0, 27], 128, 256, seed=5, trailing_tokens=3)
    table = decomp.blockwise_decompositions(BLOCKWISE)
    q, scale = ops.blockwise_quantize_rows(x, "emulated")
    assert_all_equal(table[ops.blockwise_quantize_rows.default](x, "scaled_mm"), (q, scale), "quantize_rows")
    want = ops.blockwise_grouped_mm_on_rows(q, scale, w_t, offs, "emulated")
    assert torch.equal(table[ops.blockwise_grouped_mm_on_rows.default](q, scale, w_t, offs, "scaled_mm"), want)
    assert torch.equal(want, ops.blockwise_grouped_mm(x, w_t, offs, False, "emulated"))


# ---- AOTAutograd applies the table: the graphs hold the GEMM ops and plain-torch quantization -------------

def _block(x, w, w_t, offs, kernel):
    h = ops.blockwise_linear(x, w, None, False, kernel)
    return ops.blockwise_grouped_mm(torch.relu(h).reshape(-1, h.shape[-1]), w_t, offs, False, kernel)


def _block_inputs(seed):
    x, w, _ = linear_inputs((2, 25, 128), 256, seed=seed)
    _, w_t, offs, g = grouped_inputs([20, 0, 27], 256, 128, seed=seed + 1, trailing_tokens=3)
    return g, x, w, w_t, offs


def test_aot_graphs_hold_the_gemm_ops_and_no_blockwise_op(blockwise_scaled_mm_on_cpu):
    g, x, w, w_t, offs = _block_inputs(5)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _block(*a, "scaled_mm"), backend=_graphs_backend(graphs), fullgraph=True)
    got = forward_backward(compiled, g, x, w, w_t, offs)
    assert GEMM_OPS <= graphs["fw"] and GEMM_OPS <= graphs["bw"]
    assert not (graphs["fw"] | graphs["bw"]) & BLOCKWISE_OPS
    assert torch.ops.aten.amax.default in graphs["fw"] and torch.ops.aten.amax.default in graphs["bw"]
    assert_all_equal(got, forward_backward(lambda *a: _block(*a, "emulated"), g, x, w, w_t, offs), "block")


def test_triton_kernel_graphs_hold_its_grouped_gemm_op_and_the_linears_scaled_mm(blockwise_scaled_mm_on_cpu):
    """Kernel "triton" serves grouped GEMMs only (the recipe gives linears "scaled_mm"): its grouped ops decompose
    around moepass::blockwise_triton_grouped_mm, in the forward and both backward GEMMs, bit-equal to emulated."""
    g, x, w, w_t, offs = _block_inputs(8)

    def block(x, w, w_t, offs, kernels):
        h = ops.blockwise_linear(x, w, None, False, kernels[0])
        return ops.blockwise_grouped_mm(torch.relu(h).reshape(-1, h.shape[-1]), w_t, offs, False, kernels[1])

    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: block(*a, ("scaled_mm", "triton")), backend=_graphs_backend(graphs),
                             fullgraph=True)
    got = forward_backward(compiled, g, x, w, w_t, offs)
    triton_op = ops.blockwise_triton_grouped_mm.default
    assert triton_op in graphs["fw"] and triton_op in graphs["bw"]
    assert ops.blockwise_scaled_grouped_mm.default not in graphs["fw"] | graphs["bw"]
    assert ops.blockwise_scaled_mm.default in graphs["fw"] and not (graphs["fw"] | graphs["bw"]) & BLOCKWISE_OPS
    want = forward_backward(lambda *a: block(*a, ("emulated", "emulated")), g, x, w, w_t, offs)
    assert_all_equal(got, want, "block")


def test_emulated_graphs_keep_the_ops():
    g, x, w, w_t, offs = _block_inputs(6)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _block(*a, "emulated"), backend=_graphs_backend(graphs), fullgraph=True)
    forward_backward(compiled, g, x, w, w_t, offs)
    assert {ops.blockwise_linear.default, ops.blockwise_grouped_mm.default} <= graphs["fw"]
    assert not (graphs["fw"] | graphs["bw"]) & GEMM_OPS


def test_dynamic_token_counts_decompose_once(blockwise_scaled_mm_on_cpu):
    graphs, counts = {}, []
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: _block(*a, "scaled_mm"), backend=_graphs_backend(graphs, counts), dynamic=True)
    for m, sizes in ((40, [20, 0, 17]), (72, [50, 10, 9]), (17, [0, 0, 17])):  # tokens % 128 and % 16 vary
        x, w, _ = linear_inputs((m, 128), 256, seed=m)
        _, w_t, offs, g = grouped_inputs(sizes, 256, 128, seed=m + 1, trailing_tokens=m - sum(sizes))
        got = forward_backward(fn, g, x, w, w_t, offs)
        assert_all_equal(got, forward_backward(lambda *a: _block(*a, "emulated"), g, x, w, w_t, offs), f"M={m}")
    assert len(counts) == 1 and GEMM_OPS <= graphs["fw"]


# ---- Inductor on CPU: fused quantization, bit for bit ------------------------------------------------------

def test_inductor_compiles_the_decomposed_block_bit_equal_to_emulated(blockwise_scaled_mm_on_cpu):
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    decomp.register_inductor_fallbacks(BLOCKWISE)
    table = {**select_decomp_table(), **decomp.blockwise_decompositions(BLOCKWISE)}
    g, x, w, w_t, offs = _block_inputs(7)
    torch._dynamo.reset()
    with compile_caches_off():
        compiled = torch.compile(lambda *a: _block(*a, "scaled_mm"), fullgraph=True,
                                 backend=lambda gm, ex: compile_fx(gm, ex, decompositions=table))
        got = forward_backward(compiled, g, x, w, w_t, offs)
    assert_all_equal(got, forward_backward(lambda *a: _block(*a, "emulated"), g, x, w, w_t, offs), "block")


def test_the_backend_compiles_blockwise_linears_bit_equal_to_emulated(blockwise_scaled_mm_on_cpu):
    results, audits = two_linears_per_kernel("blockwise", ("scaled_mm", "emulated"), 128, 256)
    # `up` is rewritten (`down`, the last linear, is left alone as an output head): its forward and wgrad
    fp8 = audits["scaled_mm"]
    assert fp8["forward"].get("moepass.blockwise_scaled_mm") == 1, fp8
    assert fp8["backward"].get("moepass.blockwise_scaled_mm") == 1, fp8
    assert not any(op.startswith("moepass.blockwise_linear") for ops_ in fp8.values() for op in ops_), fp8
    assert audits["emulated"]["forward"].get("moepass.blockwise_linear") == 1
    for a, b in zip(results["scaled_mm"], results["emulated"]):
        assert torch.equal(a, b)
