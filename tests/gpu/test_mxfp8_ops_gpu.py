"""moepass::mxfp8_* ops on CUDA: emulated numerics equal torchao's there; sm100 kernels on Blackwell only."""

from __future__ import annotations

import pytest
import torch

import moepass.ops  # noqa: F401
from moepass.ops.lowp.mxfp8.kernels.choice import choose_mxfp8_kernel
from helpers import MXFP8_GROUPED_SHAPES as GROUPED_SHAPES
from helpers import compile_caches_off
from helpers import MXFP8_LINEAR_SHAPES as LINEAR_SHAPES
from helpers import MXFP8_SQNR_BARS as SQNR_BARS
from helpers import (assert_all_equal, assert_sqnr, forward_backward, grouped_inputs, grouped_reference, linear_inputs,
                     linear_reference, sqnr, torchao_grouped, torchao_linear)
from helpers import mxfp8_op_grouped as op_grouped
from helpers import mxfp8_op_linear as op_linear

HAS_CUDA = torch.cuda.is_available()
CC = torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
needs_sm100 = pytest.mark.skipif(CC[0] != 10, reason="needs an sm_100 (Blackwell) GPU for native MXFP8")
ops = torch.ops.moepass


@pytest.mark.parametrize("scale_rounding", ["rceil", "floor"])
@pytest.mark.parametrize("case", range(len(LINEAR_SHAPES)))
def test_linear_emulated_on_cuda_equals_torchao_and_clears_bars(scale_rounding, case):
    x_shape, n = LINEAR_SHAPES[case]
    x, w, g = linear_inputs(x_shape, n, seed=1000 + case, device="cuda")
    got = op_linear(x, w, g, scale_rounding)
    if x.reshape(-1, x.shape[-1]).shape[0] % 32 == 0:  # torchao's wgrad needs tokens % 32 == 0
        assert_all_equal(got, torchao_linear(x, w, g, scale_rounding))
    assert_sqnr(linear_reference(x, w, g), got, SQNR_BARS[scale_rounding], f"cuda linear {x_shape} N={n}")


@pytest.mark.parametrize("scale_rounding", ["rceil", "floor"])
@pytest.mark.parametrize("case", range(len(GROUPED_SHAPES)))
def test_grouped_emulated_on_cuda_equals_torchao_and_clears_bars(scale_rounding, case):
    sizes, k, n = GROUPED_SHAPES[case]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=1100 + case, device="cuda")
    got = op_grouped(x, w_t, offs, g, scale_rounding)
    assert_all_equal(got, torchao_grouped(x, w_t, offs, g, scale_rounding))
    assert_sqnr(grouped_reference(x, w_t, offs, g), got, SQNR_BARS[scale_rounding], f"cuda grouped {sizes}")


@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_grouped_on_cuda_tokens_after_last_group_stay_zero(wgrad_bf16):
    x, w_t, offs, g = grouped_inputs([10, 0, 45], 64, 64, seed=1200, device="cuda", trailing_tokens=23)
    inside = int(offs[-1])
    x[inside:], g[inside:] = 1e4, 1e4
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g, wgrad_bf16=wgrad_bf16)
    assert not out[inside:].any() and not grad_x[inside:].any() and not grad_w_t[1].any()
    ref = grouped_reference(x[:inside], w_t, offs, g[:inside])
    bars = SQNR_BARS["rceil"] if not wgrad_bf16 else (*SQNR_BARS["rceil"][:2], 40.0)
    assert_sqnr(ref, (out[:inside], grad_x[:inside], grad_w_t), bars, "cuda grouped with trailing tokens")


def test_cuda_device_reports_its_kernel_choice():
    kernel, reason = choose_mxfp8_kernel(torch.device("cuda"))
    assert f"sm_{CC[0]}{CC[1]}" in reason and torch.cuda.get_device_name() in reason
    assert kernel == ("sm100" if "torchao MXFP8 kernels loaded" in reason else "emulated")
    if CC[0] != 10:
        assert kernel == "emulated" and "needs sm_100" in reason


def test_compiled_inductor_on_cuda_equals_eager():
    x, w, g = linear_inputs((2, 64, 64), 64, seed=1300, device="cuda")
    fn = lambda a, b: ops.mxfp8_linear(a, b, None, "rceil", False, "emulated")  # noqa: E731
    torch._dynamo.reset()
    got = forward_backward(torch.compile(fn, backend="inductor", fullgraph=True), g, x, w)
    for a, b in zip(got, forward_backward(fn, g, x, w)):
        assert torch.equal(a, b)


def test_inductor_fuses_emulated_mxfp8_bit_equal_to_the_ops():
    """The backend's table decomposes emulated ops on CUDA (mxfp8/decomp.py): no MXFP8 op reaches Inductor's
    post-grad graphs, BF16 GEMMs do, and forward and gradients equal the opaque ops run eagerly, bit for bit."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    from moepass.inductor_stage.cache_key import CompiledGraphAudit
    from moepass.ops.lowp.mxfp8 import decomp as mxfp8_decomp
    from moepass.ops.lowp.mxfp8.recipe import MXFP8

    def block(x, w, w_t, offs):
        h = ops.mxfp8_linear(x, w, None, "rceil", False, "emulated")
        return ops.mxfp8_grouped_mm(torch.relu(h).reshape(-1, h.shape[-1]), w_t, offs, "rceil", False, "emulated")

    mxfp8_decomp.register_inductor_fallbacks(MXFP8)
    table = {**select_decomp_table(), **mxfp8_decomp.mxfp8_decompositions(MXFP8)}
    x, w, _ = linear_inputs((300, 256), 512, seed=1400, device="cuda")
    _, w_t, offs, g = grouped_inputs([100, 0, 150, 37], 512, 256, seed=1401, device="cuda", trailing_tokens=13)
    audit = CompiledGraphAudit()
    torch._dynamo.reset()
    with compile_caches_off():
        compiled = torch.compile(block, fullgraph=True, backend=lambda gm, ex: compile_fx(
            gm, ex, decompositions=table, config_patches={"post_grad_custom_post_pass": audit}))
        got = forward_backward(compiled, g, x, w, w_t, offs)
    graphs = {c["kind"]: c["ops"] for c in audit.sink}
    assert set(graphs) == {"forward", "backward"}
    assert not any(op.startswith("moepass.mxfp8") for ops_ in graphs.values() for op in ops_), graphs
    assert graphs["forward"].get("aten.mm") and graphs["forward"].get("aten._grouped_mm"), graphs
    assert_all_equal(got, forward_backward(block, g, x, w, w_t, offs), "block")


# ---- kernel="sm100" ------------------------------------------------------------------------------

@pytest.mark.sm100
@needs_sm100
@pytest.mark.parametrize("case", range(len(GROUPED_SHAPES)))
def test_sm100_grouped_clears_bars_and_tracks_emulated(case):
    sizes, k, n = GROUPED_SHAPES[case]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=1400 + case, device="cuda")
    got = op_grouped(x, w_t, offs, g, kernel="sm100")
    assert_sqnr(grouped_reference(x, w_t, offs, g), got, SQNR_BARS["rceil"], f"sm100 grouped {sizes}")
    for a, b in zip(got, op_grouped(x, w_t, offs, g, kernel="emulated")):
        assert sqnr(b, a) >= 35.0  # same quantized operands; only GEMM accumulation order differs


@pytest.mark.sm100
@needs_sm100
@pytest.mark.parametrize("case", range(len(LINEAR_SHAPES)))
def test_sm100_linear_clears_bars_and_tracks_emulated(case):
    x_shape, n = LINEAR_SHAPES[case]
    x, w, g = linear_inputs(x_shape, n, seed=1500 + case, device="cuda")
    got = op_linear(x, w, g, kernel="sm100")
    assert_sqnr(linear_reference(x, w, g), got, SQNR_BARS["rceil"], f"sm100 linear {x_shape}")
    for a, b in zip(got, op_linear(x, w, g, kernel="emulated")):
        assert sqnr(b, a) >= 35.0


@pytest.mark.skipif(CC[0] == 10, reason="needs a CUDA GPU that is not sm_100")
def test_sm100_kernel_off_blackwell_raises_pointing_to_emulated():
    x, w, _ = linear_inputs((32, 64), 32, seed=1600, device="cuda")
    with pytest.raises(RuntimeError, match=rf"kernel='sm100' cannot run here: .*sm_{CC[0]}{CC[1]}.*kernel='emulated'"):
        ops.mxfp8_linear(x, w, None, "rceil", False, "sm100")
    xg, w_t, offs, _ = grouped_inputs([32], 64, 32, seed=1601, device="cuda")
    with pytest.raises(RuntimeError, match=r"kernel='emulated'"):
        ops.mxfp8_grouped_mm(xg, w_t, offs, "rceil", False, "sm100")
