"""moepass::blockwise_* ops (DeepSeek-V3's FP8 recipe: 1x128 tiles, 128x128 weight blocks) on CPU, kernel "emulated"
(GPU kernels in test_blockwise_gpu.py).

The quantizers' tile and block structure; every GEMM bit for bit against a second writing of the recipe here
(its own per-tile loops, then dequantize and an fp32 GEMM); accuracy against fp32; padding and empty token groups;
bad shapes; autograd against the dgrad / wgrad ops called by hand; opcheck; the kernel choice per device (capability
mocked); and the debug model compiled with recipe="blockwise".
"""

from __future__ import annotations

import subprocess

import pytest
import torch

import moepass.ops  # noqa: F401  (registers the ops)
from moepass.ops.lowp.blockwise import quant
from moepass.ops.lowp.blockwise.kernels import choice
from moepass.ops.lowp.blockwise.recipe import BLOCKWISE
from moepass.options import Config, OptionsError
from moepass.recipes.plan import GemmPlan, plan_gemm
from moepass.skips import SkipCode
from helpers import (assert_sqnr, compile_caches_off, forward_backward, grouped_inputs, grouped_reference,
                     linear_inputs, linear_reference)

ops = torch.ops.moepass
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
T = 128
SQNR_BARS = (27.0, 27.0, 27.0)  # (out, grad input, grad weight) dB; measured ~28.6 on these inputs


def op_linear(x, w, grad_out, wgrad_bf16=False, bias=None):
    if bias is None:
        return forward_backward(lambda a, b: ops.blockwise_linear(a, b, None, wgrad_bf16, "emulated"), grad_out, x, w)
    return forward_backward(lambda a, b, c: ops.blockwise_linear(a, b, c, wgrad_bf16, "emulated"), grad_out, x, w,
                            bias)


def op_grouped(x, w_t, offs, grad_out, wgrad_bf16=False):
    return forward_backward(lambda a, b: ops.blockwise_grouped_mm(a, b, offs, wgrad_bf16, "emulated"), grad_out,
                            x, w_t)


# ---- a second writing of the recipe: loops over tiles, scale = amax / 448, dequantize, fp32 GEMM ----------
# (amax / 448 computed as amax * fp32(1/448), as quant.py does: the product Inductor's Triton code computes too)

INV_448 = torch.tensor(1 / 448.0)  # fp32


def hand_tiles(t: torch.Tensor) -> torch.Tensor:
    """Dequantized [R, C] with one scale per 128 consecutive elements of each row, tile by tile."""
    out = torch.empty(t.shape, dtype=torch.float32)
    for c in range(0, t.shape[1], T):
        tile = t[:, c:c + T].float()
        scale = tile.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) * INV_448
        out[:, c:c + T] = (tile / scale).clamp(-448, 448).to(E4M3).float() * scale
    return out


def hand_blocks(w: torch.Tensor) -> torch.Tensor:
    """Dequantized [R, C] with one scale per 128x128 block, block by block."""
    out = torch.empty(w.shape, dtype=torch.float32)
    for r in range(0, w.shape[0], T):
        for c in range(0, w.shape[1], T):
            block = w[r:r + T, c:c + T].float()
            scale = block.abs().amax().clamp(min=1e-12) * INV_448
            out[r:r + T, c:c + T] = (block / scale).clamp(-448, 448).to(E4M3).float() * scale
    return out


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T in fp32, rounded to bf16 once; b contiguous then transposed, the layout the op's GEMM reads, so the
    fp32 sums run in the same order and the comparison can be exact."""
    return torch.mm(a, b.contiguous().t()).to(BF16)


def hand_linear(x, w, g):
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    out = nt(hand_tiles(x2), hand_blocks(w))
    grad_x = nt(hand_tiles(g2), hand_blocks(w).t())  # the same blocks, read transposed
    tokens = -(-x2.shape[0] // T) * T
    grad_w = nt(hand_tiles(pad_rows(g2, tokens).t()), hand_tiles(pad_rows(x2, tokens).t()))  # tiles down tokens
    return out.reshape(g.shape), grad_x.reshape(x.shape), grad_w


def hand_grouped(x, w_t, offs, g):
    out, grad_x = torch.zeros_like(g), torch.zeros_like(x)
    grad_w_t = torch.zeros_like(w_t)
    xd, gd = hand_tiles(x), hand_tiles(g)  # tiles along K (or N): per row, groups do not matter
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w = hand_blocks(w_t[e].t())  # [N, K]
            out[start:end] = nt(xd[start:end], w)
            grad_x[start:end] = nt(gd[start:end], w.t())
            rows = -(-(end - start) // T) * T  # the group alone, padded to whole tiles
            grad_w_t[e] = nt(hand_tiles(pad_rows(g[start:end], rows).t()),
                             hand_tiles(pad_rows(x[start:end], rows).t())).t()
        start = end
    return out, grad_x, grad_w_t


# ---- the quantizers --------------------------------------------------------------------------------

def _spread(shape, seed):
    """Values over ~12 binades, different per column, so tiles and blocks get very different scales."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 6, shape[-1:], generator=gen))).to(BF16)


def test_each_1x128_tile_maps_its_max_abs_to_448_with_an_fp32_scale():
    t = _spread((64, 384), seed=1)
    q, scale = quant.quantize_tiles(t)
    assert q.dtype == E4M3 and q.shape == t.shape and scale.dtype == torch.float32 and scale.shape == (64, 3)
    tiles = t.float().reshape(64, 3, T)
    assert torch.equal(scale, tiles.abs().amax(-1) * INV_448)  # amax / 448, no power-of-two rounding
    assert torch.equal(q.float().abs().reshape(64, 3, T).amax(-1), torch.full((64, 3), 448.0))
    top = tiles.abs().argmax(-1, keepdim=True)  # the largest element of each tile becomes +-448 exactly
    assert torch.equal(q.float().reshape(64, 3, T).gather(-1, top).abs(), torch.full((64, 3, 1), 448.0))
    deq = quant.dequantize_tiles(q, scale)
    assert ((deq - t.float()).abs() <= 2**-4 * t.float().abs() + 2**-9 * scale.repeat_interleave(T, 1)).all()


def test_a_128x128_block_shares_one_scale_and_serves_both_orientations():
    w = _spread((256, 384), seed=2)
    w[5, 200] = 1000.0  # one outlier: only its block's scale moves
    q, scale = quant.quantize_blocks(w)
    assert q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (2, 3)
    blocks = w.float().reshape(2, T, 3, T)
    assert torch.equal(scale, blocks.abs().amax(dim=(1, 3)) * INV_448)
    assert scale[0, 1] == 1000.0 * INV_448 and (scale.flatten()[torch.arange(6) != 1] < 1000.0 * INV_448).all()
    q_t, scale_t = quant.quantize_blocks(w.t())  # the dgrad reads the same blocks transposed
    assert torch.equal(q_t.view(torch.uint8), q.t().contiguous().view(torch.uint8)) and torch.equal(scale_t, scale.t())
    experts = torch.stack([w, -w])  # leading dims: one block grid per expert
    q3, scale3 = quant.quantize_blocks(experts)
    assert scale3.shape == (2, 2, 3) and torch.equal(scale3[1], scale) and torch.equal(q3[0].float(), q.float())


def test_all_zero_tiles_quantize_to_zero_with_a_finite_scale():
    q, scale = quant.quantize_tiles(torch.zeros(4, 256, dtype=BF16))
    assert torch.equal(q.float(), torch.zeros(4, 256)) and torch.isfinite(scale).all() and (scale > 0).all()


def test_the_quantizers_equal_the_hand_written_loops():
    t = _spread((96, 256), seed=3)
    assert torch.equal(quant.dequantize_tiles(*quant.quantize_tiles(t)), hand_tiles(t))
    w = _spread((256, 128), seed=4)
    assert torch.equal(quant.dequantize_blocks(*quant.quantize_blocks(w)), hand_blocks(w))


# ---- every GEMM bit for bit, and against fp32 ------------------------------------------------------

LINEAR_SHAPES = [((200, 256), 256), ((2, 100, 256), 384), ((128, 128), 128), ((3, 384), 256)]
GROUPED_SHAPES = [([70, 0, 130, 33], 256, 384, 0), ([128, 256], 128, 256, 5), ([1, 0, 0], 256, 128, 2)]


@pytest.mark.parametrize("x_shape, n", LINEAR_SHAPES)
def test_linear_forward_dgrad_wgrad_equal_the_hand_written_recipe(x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=10)
    got = op_linear(x, w, g)
    for name, a, b in zip(("out", "grad_x", "grad_w"), got, hand_linear(x, w, g)):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("group_sizes, k, n, trailing", GROUPED_SHAPES)
def test_grouped_forward_dgrad_wgrad_equal_the_hand_written_recipe(group_sizes, k, n, trailing):
    x, w_t, offs, g = grouped_inputs(group_sizes, k, n, seed=11, trailing_tokens=trailing)
    got = op_grouped(x, w_t, offs, g)
    for name, a, b in zip(("out", "grad_x", "grad_w_t"), got, hand_grouped(x, w_t, offs, g)):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("x_shape, n", LINEAR_SHAPES[:2])
def test_linear_within_fp8_error_of_fp32(x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=12)
    assert_sqnr(linear_reference(x, w, g), op_linear(x, w, g), SQNR_BARS, f"linear {x_shape} x {n}")


@pytest.mark.parametrize("group_sizes, k, n, trailing", GROUPED_SHAPES[:2])
def test_grouped_within_fp8_error_of_fp32(group_sizes, k, n, trailing):
    x, w_t, offs, g = grouped_inputs(group_sizes, k, n, seed=13, trailing_tokens=trailing)
    assert_sqnr(grouped_reference(x, w_t, offs, g), op_grouped(x, w_t, offs, g), SQNR_BARS, f"grouped {group_sizes}")


def test_per_tile_scales_keep_a_quiet_tile_accurate_next_to_an_outlier():
    """One scale per 128 elements: an outlier in one tile of a row costs the row's other tiles nothing (a per-row
    scale would push them into e4m3's subnormals)."""
    x, w, g = linear_inputs((64, 256), 128, seed=14)
    x[:, :T] *= 2**12  # the first tile of every row, 4096x larger
    w[:, :T] /= 2**12
    x_q, x_scale = quant.quantize_tiles(x)
    quiet = quant.dequantize_tiles(x_q, x_scale)[:, T:]
    assert ((quiet - x[:, T:].float()).norm() / x[:, T:].float().norm()) < 0.04


# ---- padding, token groups -------------------------------------------------------------------------

def test_linear_wgrad_pads_tokens_with_zero_rows_that_change_nothing():
    x, w, g = linear_inputs((200, 256), 256, seed=20)
    padded = ops.blockwise_linear_wgrad(pad_rows(g, 256), pad_rows(x, 256), "emulated")
    assert torch.equal(ops.blockwise_linear_wgrad(g, x, "emulated"), padded)


def test_tokens_after_the_last_group_give_zeros_and_touch_no_gradient():
    x, w_t, offs, g = grouped_inputs([70, 0, 60], 256, 128, seed=21, trailing_tokens=9)
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g)
    assert torch.equal(out[130:], torch.zeros(9, 128, dtype=BF16)) and not grad_x[130:].any()
    x2, g2 = x.clone(), g.clone()
    x2[130:], g2[130:] = 1e4, -1e4  # whatever sits there, no group reads it
    out2, grad_x2, grad_w_t2 = op_grouped(x2, w_t, offs, g2)
    assert torch.equal(out2[:130], out[:130]) and torch.equal(grad_x2, grad_x) and torch.equal(grad_w_t2, grad_w_t)


def test_wgrad_tiles_never_straddle_token_groups():
    """Group 0's huge values would set the tokens' tile scale of group 1's first rows if a tile crossed the boundary
    (70 is not a multiple of 128): group 1's weight gradient must equal that of group 1 alone."""
    x, w_t, offs, g = grouped_inputs([70, 60], 256, 128, seed=22)
    x[:70] *= 2**10
    g[:70] *= 2**10
    grad_w_t = ops.blockwise_grouped_mm_wgrad(g, x, offs, "emulated")
    alone = ops.blockwise_grouped_mm_wgrad(g[70:], x[70:], torch.tensor([0, 60], dtype=torch.int32), "emulated")
    assert torch.equal(grad_w_t[1], alone[1])


def test_empty_groups_get_exactly_zero_weight_gradients():
    x, w_t, offs, g = grouped_inputs([0, 140, 0, 7], 128, 256, seed=23)
    _, _, grad_w_t = op_grouped(x, w_t, offs, g)
    assert not grad_w_t[0].any() and not grad_w_t[2].any() and grad_w_t[1].any() and grad_w_t[3].any()
    assert grad_w_t.stride(1) == 1  # [E, K, N] stored as [E, N, K]: w_t's own layout, w's gradient without a copy


def test_no_tokens_at_all():
    x, w, g = linear_inputs((0, 256), 128, seed=24)
    out, grad_x, grad_w = op_linear(x, w, g)
    assert out.shape == (0, 128) and grad_x.shape == (0, 256) and torch.equal(grad_w, torch.zeros(128, 256, dtype=BF16))
    x, w_t, offs, g = grouped_inputs([0, 0], 128, 128, seed=25, trailing_tokens=3)
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g)
    assert not out.any() and not grad_x.any() and not grad_w_t.any()


# ---- autograd against the backward ops called by hand ---------------------------------------------

@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_linear_autograd_calls_exactly_the_dgrad_and_wgrad_ops(wgrad_bf16):
    x, w, g = linear_inputs((2, 70, 256), 128, seed=30)
    bias = torch.randn(128).to(BF16)
    out, grad_x, grad_w, grad_b = op_linear(x, w, g, wgrad_bf16, bias=bias)
    assert torch.equal(out, ops.blockwise_linear(x, w, bias, wgrad_bf16, "emulated"))
    assert torch.equal(grad_x, ops.blockwise_linear_dgrad(g, w, "emulated"))
    g2, x2 = g.reshape(-1, 128), x.reshape(-1, 256)
    assert torch.equal(grad_w, torch.mm(g2.t(), x2) if wgrad_bf16 else ops.blockwise_linear_wgrad(g, x, "emulated"))
    assert torch.equal(grad_b, g2.sum(0, dtype=torch.float32).to(BF16))


@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_grouped_autograd_calls_exactly_the_dgrad_and_wgrad_ops(wgrad_bf16):
    x, w_t, offs, g = grouped_inputs([50, 0, 90], 128, 256, seed=31, trailing_tokens=4)
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g, wgrad_bf16)
    assert torch.equal(out, ops.blockwise_grouped_mm(x, w_t, offs, wgrad_bf16, "emulated"))
    assert torch.equal(grad_x, ops.blockwise_grouped_mm_dgrad(g, w_t, offs, "emulated"))
    wgrad = ops.grouped_mm_wgrad_bf16 if wgrad_bf16 else ops.blockwise_grouped_mm_wgrad
    want = wgrad(g, x, offs) if wgrad_bf16 else wgrad(g, x, offs, "emulated")
    assert torch.equal(grad_w_t, want)


def _opcheck_cases():
    x, w, g = linear_inputs((70, 256), 128, seed=32)
    xg, w_t, offs, gg = grouped_inputs([50, 0, 90], 128, 256, seed=33, trailing_tokens=4)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    return {
        "linear": (ops.blockwise_linear, (leaf(x), leaf(w), leaf(torch.randn(128).to(BF16)), False, "emulated")),
        "linear_dgrad": (ops.blockwise_linear_dgrad, (g, w, "emulated")),
        "linear_wgrad": (ops.blockwise_linear_wgrad, (g, x, "emulated")),
        "grouped": (ops.blockwise_grouped_mm, (leaf(xg), leaf(w_t), offs, False, "emulated")),
        "grouped_dgrad": (ops.blockwise_grouped_mm_dgrad, (gg, w_t, offs, "emulated")),
        "grouped_wgrad": (ops.blockwise_grouped_mm_wgrad, (gg, xg, offs, "emulated")),
    }


@pytest.mark.parametrize("name", list(_opcheck_cases()))
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    torch.library.opcheck(op.default, args)


# ---- bad inputs ------------------------------------------------------------------------------------

def test_k_or_n_off_the_128_block_is_rejected_naming_the_fix():
    x, w, _ = linear_inputs((32, 192), 128, seed=40)
    with pytest.raises(ValueError, match=r"blockwise_linear: K=192 is not a multiple of 128 .*pad K to a multiple "
                                         r"of 128 or leave this GEMM in BF16"):
        ops.blockwise_linear(x, w, None, False, "emulated")
    x, w, g = linear_inputs((32, 128), 64, seed=41)
    with pytest.raises(ValueError, match=r"N=64 is not a multiple of 128"):
        ops.blockwise_linear_dgrad(g, w, "emulated")
    xg, w_t, offs, gg = grouped_inputs([16, 16], 256, 96, seed=42)
    with pytest.raises(ValueError, match=r"blockwise_grouped_mm: N=96 is not a multiple of 128"):
        ops.blockwise_grouped_mm(xg, w_t, offs, False, "emulated")
    with pytest.raises(ValueError, match=r"blockwise_grouped_mm_wgrad: N=96 is not a multiple of 128"):
        ops.blockwise_grouped_mm_wgrad(gg, xg, offs, "emulated")
    assert BLOCKWISE.shape_problem(256, 160).code is SkipCode.NOT_A_MULTIPLE
    # the block the recipe states is its quantizer's, and its kernels' reasons name its own kernel option
    assert BLOCKWISE.multiple == quant.TILE == 128 and choice.KERNEL_OPTION == BLOCKWISE.kernel_option


def test_bad_kernel_names_and_kernels_that_cannot_run_here_are_refused():
    x, w, _ = linear_inputs((32, 128), 128, seed=43)
    with pytest.raises(ValueError, match=r"'emulated', 'scaled_mm', 'triton', 'deepgemm'"):
        ops.blockwise_linear(x, w, None, False, "cutlass")
    with pytest.raises(RuntimeError, match=r"kernel='scaled_mm' cannot run here: CPU.*kernel='emulated'"):
        ops.blockwise_linear(x, w, None, False, "scaled_mm")
    xg, w_t, offs, _ = grouped_inputs([16, 16], 128, 128, seed=44)
    with pytest.raises(RuntimeError, match=r"kernel='deepgemm' cannot run here"):
        ops.blockwise_grouped_mm(xg, w_t, offs, False, "deepgemm")


# ---- kernel choice per device ----------------------------------------------------------------------

@pytest.fixture
def cuda_capability(monkeypatch):
    """Pretend this process sees one CUDA GPU of the given compute capability; the device probes answer `scaled_mm`,
    `triton` and `deepgemm` (None: usable) instead of running anything."""
    def set_capability(major, minor, scaled_mm=None, deepgemm="deep_gemm is not installed",
                       triton="triton is not installed"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"Test GPU sm_{major}{minor}")
        monkeypatch.setattr(choice, "_scaled_mm_problem_on", lambda index: scaled_mm)
        monkeypatch.setattr(choice, "_deepgemm_problem_on", lambda index: deepgemm)
        monkeypatch.setattr(choice, "_triton_problem_on", lambda index: triton)
    return set_capability


def _plan(kind, **options):
    config = Config.from_options({"recipe": "blockwise", **options})
    return plan_gemm(config, kind, torch.device("cuda"), 4096, 1024, 2048, experts=8)


def test_cpu_runs_the_emulated_kernel_saying_why():
    for kind in ("linear", "grouped"):
        plan = plan_gemm(Config.from_options({"recipe": "blockwise"}), kind, torch.device("cpu"), 256, 256, 128,
                         experts=2)
        assert isinstance(plan, GemmPlan) and plan.kernel == "emulated" and "CPU" in plan.kernel_why, plan
        assert plan.op_name == f"blockwise_{'linear' if kind == 'linear' else 'grouped_mm'}"
        assert plan.recipe_args == (False, "emulated")
    with pytest.raises(OptionsError, match=r"blockwise.kernel='scaled_mm' requested but CPU"):
        plan_gemm(Config.from_options({"recipe": "blockwise", "blockwise.kernel": "scaled_mm"}), "linear",
                  torch.device("cpu"), 256, 256, 128)


def test_sm90_linears_take_scaled_mm_and_grouped_gemms_the_per_group_loop(cuda_capability):
    cuda_capability(9, 0, triton=None, deepgemm=None)  # Triton and DeepGEMM would run: the measured loop is chosen
    linear, grouped = _plan("linear"), _plan("grouped")
    assert linear.kernel == "scaled_mm" and "torch._scaled_mm" in linear.kernel_why and "sm_90" in linear.kernel_why
    assert grouped.kernel == "scaled_mm" and "one per token group" in grouped.kernel_why
    assert "blockwise.kernel='triton'" in grouped.kernel_why and "blockwise.kernel='deepgemm'" in grouped.kernel_why


def test_the_triton_kernels_serve_grouped_gemms_where_scaled_mm_cannot_and_on_request(cuda_capability):
    cuda_capability(10, 0, triton=None)  # torch._scaled_mm takes blockwise scales on sm_90 only
    grouped = _plan("grouped")
    assert grouped.kernel == "triton" and "Triton" in grouped.kernel_why and "sm_90 only" in grouped.kernel_why
    assert grouped.recipe_args == (False, "triton")
    assert _plan("linear").code is SkipCode.NO_KERNEL  # the linears have no blockwise kernel there
    cuda_capability(9, 0, triton=None)
    assert _plan("grouped", **{"blockwise.kernel": "triton"}).kernel == "triton"
    assert _plan("linear", **{"blockwise.kernel": "triton"}).kernel == "scaled_mm"  # Triton: grouped only


def test_a_failed_triton_check_is_the_reason_and_a_request_for_it_is_refused(cuda_capability):
    cuda_capability(10, 0, triton="the Triton K-grouped (wgrad) kernel failed: out of resources")
    grouped = _plan("grouped")
    assert grouped.code is SkipCode.NO_KERNEL and "out of resources" in grouped.text and "sm_90 only" in grouped.text
    cuda_capability(9, 0, triton="the Triton K-grouped (wgrad) kernel failed: out of resources")
    with pytest.raises(OptionsError, match=r"blockwise.kernel='triton' requested but .*out of resources"):
        _plan("grouped", **{"blockwise.kernel": "triton"})
    cuda_capability(8, 0, triton=None)  # no FP8 tensor cores: never asked
    assert "sm_89 or newer" in _plan("grouped").text


def test_deepgemm_runs_grouped_gemms_on_request_only_once_it_passes_its_self_check(cuda_capability):
    cuda_capability(10, 0, deepgemm=None)  # not even where nothing else runs: slower than BF16, failed in a step
    assert _plan("grouped").code is SkipCode.NO_KERNEL
    cuda_capability(9, 0, deepgemm=None)
    assert _plan("grouped").kernel == "scaled_mm"
    assert _plan("grouped", **{"blockwise.kernel": "deepgemm"}).kernel == "deepgemm"
    assert _plan("linear", **{"blockwise.kernel": "deepgemm"}).kernel == "scaled_mm"  # DeepGEMM: grouped only
    assert _plan("grouped", **{"blockwise.kernel": "scaled_mm"}).kernel == "scaled_mm"
    assert _plan("grouped", **{"blockwise.kernel": "emulated"}).kernel == "emulated"


def test_other_gpus_keep_bf16_with_a_coded_reason(cuda_capability):
    cuda_capability(8, 0)
    for kind in ("linear", "grouped"):
        reason = _plan(kind)
        assert reason.code is SkipCode.NO_KERNEL and SkipCode.NO_KERNEL.phrase in reason.text, reason
        assert "sm_90 only" in reason.text and "blockwise.kernel='emulated'" in reason.text
    assert _plan("linear", **{"blockwise.kernel": "emulated"}).kernel == "emulated"
    with pytest.raises(OptionsError, match=r"blockwise.kernel='scaled_mm' requested but .*sm_90 only"):
        _plan("linear", **{"blockwise.kernel": "scaled_mm"})


def test_a_failed_scaled_mm_probe_keeps_bf16_saying_what_torch_said(cuda_capability):
    cuda_capability(9, 0, scaled_mm="torch._scaled_mm refused 1x128 x 128x128 blockwise scales: Invalid scaling")
    reason = _plan("grouped")
    assert reason.code is SkipCode.NO_KERNEL and "Invalid scaling" in reason.text
    assert "triton is not installed" in reason.text


def test_deepgemm_self_check_runs_apart_and_a_crash_is_a_verdict(monkeypatch):
    """The check runs in a child process, once per device: a segfault there keeps DeepGEMM off, with the reason."""
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]["CUDA_VISIBLE_DEVICES"]))
        return subprocess.CompletedProcess(cmd, -11, stdout="", stderr="Fatal Python error: Segmentation fault")

    monkeypatch.setattr(choice.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(choice.subprocess, "run", run)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    choice._deepgemm_problem_on.cache_clear()
    try:
        problem = choice._deepgemm_problem_on(1)
        assert problem == "DeepGEMM's self-check died of signal 11 (Fatal Python error: Segmentation fault)"
        assert choice._deepgemm_problem_on(1) is problem and len(calls) == 1  # cached
        assert calls[0][0][-2:] == ["-m", choice.DEEPGEMM_CHECK_MODULE] and calls[0][1] == "1"
    finally:
        choice._deepgemm_problem_on.cache_clear()


def test_recipe_auto_never_picks_blockwise(cuda_capability):
    from moepass.recipes.plan import resolve_recipe

    assert resolve_recipe("auto", "cpu", "linear", 4096, 1024, 2048)[0] == "mxfp8"
    cuda_capability(9, 0)
    assert resolve_recipe("auto", "cuda", "linear", 16384, 7168, 18432)[0] == "fp8_rowwise"
    assert resolve_recipe("blockwise", "cuda", "linear", 16384, 7168, 18432)[0] == "blockwise"


# ---- the debug model, compiled ---------------------------------------------------------------------

def test_debug_model_compiled_with_recipe_blockwise_trains_and_reports_its_rewrites():
    """Two layers (one dense, one MoE) of the debug DeepSeek-V3: every expert GEMM and every linear whose K and N are
    multiples of 128 becomes a blockwise op; wkv_a (N = 128 + 32) stays BF16 saying why."""
    import moepass
    from moepass.harness.train import next_token_loss
    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=2)
    reference = next_token_loss(model(tokens := torch.randint(0, 2048, (2, 64))), tokens).item()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moepass", options={"recipe": "blockwise"})
    with moepass.collecting() as report, compile_caches_off():
        loss = next_token_loss(compiled(tokens), tokens)
        loss.backward()
    passes = {p["name"]: p for p in report.to_dict()["passes"]}
    grouped, linear = passes["grouped_mm"], passes["linear"]
    assert grouped["replaced"] == 3 and grouped["skipped"] == []
    assert linear["replaced"] == 12, [r["module"] for r in linear["rewrites"]]  # wq, wkv_b, wo x2; 2 FFNs x 3
    skipped = {s["module"]: s["reason"] for s in linear["skipped"]}
    assert set(skipped) == {"layers.0.attention.wkv_a", "layers.1.attention.wkv_a", "layers.1.moe.router.gate",
                            "output"}
    assert "blockwise: N=160 not a multiple of 128" in skipped["layers.0.attention.wkv_a"]
    assert {r["op"] for r in grouped["rewrites"] + linear["rewrites"]} == {
        "moepass.blockwise_grouped_mm", "moepass.blockwise_linear"}
    assert set(grouped["implementations"]) == set(linear["implementations"]) == {"emulated"}
    backward = [c["ops"] for c in report.compiled if c["kind"] == "backward"]
    for op in ("linear_dgrad", "linear_wgrad", "grouped_mm_dgrad", "grouped_mm_wgrad"):
        assert backward and backward[0].get(f"moepass.blockwise_{op}", 0) > 0, (op, backward)
    assert abs(loss.item() - reference) / reference < 0.02, (loss.item(), reference)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
