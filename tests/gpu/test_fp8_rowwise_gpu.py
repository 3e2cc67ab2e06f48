"""moepass::fp8_rowwise_* on CUDA: the real kernels (Triton quantization, torch._scaled_mm / _scaled_grouped_mm)
against the emulated path, the SQNR bars, token groups of any size, compile, and the debug model's loss."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import moepass.ops.lowp.fp8_rowwise  # noqa: F401  (registers the ops)
from moepass.recipes import auto
from moepass.ops.lowp.fp8_rowwise import quant
from moepass.ops.lowp.fp8_rowwise.kernels.choice import choose_fp8_rowwise_kernel
from helpers import FP8_ROWWISE_SQNR_BARS as SQNR_BARS
from helpers import (assert_sqnr, forward_backward, grouped_inputs, grouped_reference, linear_inputs, linear_reference,
                     sqnr)
from helpers import fp8_rowwise_op_grouped as op_grouped
from helpers import fp8_rowwise_op_linear as op_linear

HAS_CUDA = torch.cuda.is_available()
CC = torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
needs_sm90 = pytest.mark.skipif(CC[0] != 9, reason="torch._scaled_grouped_mm rowwise runs on sm_90 only")
needs_fp8 = pytest.mark.skipif(CC < (8, 9), reason="FP8 tensor cores need sm_89+")
ops = torch.ops.moepass
CLOSE_TO_EMULATED_DB = 35.0  # same quantized operands; only accumulation order and fast accumulation differ


def test_cuda_device_reports_its_kernel_choice():
    for grouped in (False, True):
        kernel, reason = choose_fp8_rowwise_kernel(torch.device("cuda"), grouped)
        assert f"sm_{CC[0]}{CC[1]}" in reason and torch.cuda.get_device_name() in reason
        if CC[0] == 9:
            assert kernel == "scaled_mm", reason


@needs_sm90
def test_recipe_auto_on_hopper_follows_the_measured_table():
    from moepass.recipes import auto_table

    table = auto_table.for_gpu(torch.cuda.get_device_name())  # this GPU model's shipped table, if one was measured
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 2048, 10944)  # 16B dense FFN: 1.14x H200, 1.03x H100
    assert recipe == "fp8_rowwise" and (table is None or table.source in reason), reason
    recipe, reason = auto.choose_recipe("cuda", "grouped", 64 * 3072, 2048, 1408, experts=64)
    assert recipe == "bf16", reason  # the 16B expert MLP lost at every load measured
    recipe, reason = auto.choose_recipe("cuda", "grouped", 64 * 2048, 7168, 2048, experts=64)
    assert recipe == "fp8_rowwise", reason  # 671B dims: 1.05x at 2048 tokens per expert
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 2048, 64)
    assert recipe == "bf16" and "too small" in reason


# ---- the quantization kernels equal the reference bit for bit, in the layouts the GEMMs need ----------

def _wide_range(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    spread = torch.exp2(torch.randint(-10, 10, shape[-1:], generator=gen).float())
    return (torch.randn(*shape, generator=gen) * spread).to("cuda", torch.bfloat16)


@needs_fp8
@pytest.mark.parametrize("shape", [(64, 48), (1000, 256), (4096, 2048)])
def test_rows_quantization_equals_the_reference(shape):
    t = _wide_range(shape, seed=shape[0])
    q, scale = quant.rows(t, "scaled_mm")  # torchao's kernel, as the grouped ops run it eagerly
    ref_q, ref_scale = quant.quantize(t, -1)
    assert q.stride(-1) == 1, q.stride()
    assert torch.equal(scale.reshape(ref_scale.shape), ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@needs_fp8
def test_expert_weight_quantization_equals_the_reference():
    w_t = _wide_range((8, 192, 256), seed=7).transpose(-2, -1)  # [E, K=256, N=192] as models pass it
    q, scale = quant.experts_along_k(w_t, "scaled_mm")
    ref_q, ref_scale = quant.quantize(w_t, 1)
    assert q.stride(1) == 1 and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    q, scale = quant.experts_along_n(w_t, "scaled_mm")
    ref_q, ref_scale = quant.quantize(w_t, 2)
    assert q.transpose(-2, -1).stride(1) == 1 and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@needs_fp8
@pytest.mark.parametrize("sizes, trailing", [([10, 0, 50, 40], 7), ([100, 33, 0, 0, 17], 3), ([0, 0, 5], 0),
                                             ([1024] * 8, 0)])
def test_token_group_quantization_writes_the_padded_wgrad_layout(sizes, trailing):
    from moepass.ops.lowp.fp8_rowwise.kernels.triton_token_group_cols import token_group_cols_padded

    d = 96
    x = _wide_range((sum(sizes) + trailing, d), seed=len(sizes))
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    q_t, scale, padded_ends = token_group_cols_padded(x, offs)
    ref_q, ref_scale = quant.token_group_cols(x, offs)
    padded = [max(-(-s // 16) * 16, 16) for s in sizes]
    assert padded_ends.tolist() == list(torch.tensor(padded).cumsum(0).tolist())
    assert torch.equal(scale, ref_scale)
    start, pstart = 0, 0
    for size, psize in zip(sizes, padded):
        block = q_t[:, pstart:pstart + psize].view(torch.uint8)
        assert torch.equal(block[:, :size], ref_q[start:start + size].t().view(torch.uint8))
        assert not block[:, size:].any()  # zero padding: adds nothing to the wgrad
        start, pstart = start + size, pstart + psize


def test_zero_rows_from_group_end():
    from moepass.ops.lowp.fp8_rowwise.kernels.triton_zero_rows import zero_rows_from_group_end_

    out = torch.randn(300, 80, device="cuda", dtype=torch.bfloat16)
    want = out.clone()
    offs = torch.tensor([100, 100, 237], device="cuda", dtype=torch.int32)
    zero_rows_from_group_end_(out, offs)
    assert torch.equal(out[:237], want[:237]) and not out[237:].any()


# ---- whole ops: the real kernels against the emulated path and the SQNR bars --------------------

LINEAR_SHAPES = [((64, 64), 96), ((2, 48, 128), 64), ((50, 256), 256), ((7, 32), 32), ((4096, 2048), 3072),
                 ((2, 1000, 1024), 512)]
GROUPED_SHAPES = [([10, 0, 50, 40], 64, 96), ([33, 31, 70], 256, 128), ([5], 32, 32), ([1, 15, 17, 0, 100], 48, 80),
                  ([1000, 0, 24, 777, 1500, 3, 2048, 700], 2048, 1408)]


@needs_fp8
@pytest.mark.parametrize("case", range(len(LINEAR_SHAPES)))
def test_linear_scaled_mm_matches_emulated_and_clears_bars(case):
    x_shape, n = LINEAR_SHAPES[case]
    x, w, g = linear_inputs(x_shape, n, seed=1000 + case, device="cuda")
    got = op_linear(x, w, g, kernel="scaled_mm")
    emulated = op_linear(x, w, g, kernel="emulated")
    for name, a, b in zip(("out", "grad input", "grad weight"), got, emulated):
        assert a.shape == b.shape and sqnr(b, a) >= CLOSE_TO_EMULATED_DB, (name, sqnr(b, a))
    assert_sqnr(linear_reference(x, w, g), got, SQNR_BARS, f"cuda linear {x_shape} N={n}")


@needs_sm90
@pytest.mark.parametrize("case", range(len(GROUPED_SHAPES)))
def test_grouped_scaled_mm_matches_emulated_and_clears_bars(case):
    sizes, k, n = GROUPED_SHAPES[case]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=1100 + case, device="cuda")
    got = op_grouped(x, w_t, offs, g, kernel="scaled_mm")
    emulated = op_grouped(x, w_t, offs, g, kernel="emulated")
    for name, a, b in zip(("out", "grad input", "grad weight"), got, emulated):
        assert a.shape == b.shape and a.stride() == b.stride(), name
        assert sqnr(b, a) >= CLOSE_TO_EMULATED_DB, (name, sqnr(b, a))
    assert_sqnr(grouped_reference(x, w_t, offs, g), got, SQNR_BARS, f"cuda grouped {sizes} K={k} N={n}")


@needs_sm90
@pytest.mark.parametrize("wgrad_bf16", [False, True])
def test_grouped_scaled_mm_tokens_after_last_group_and_empty_groups(wgrad_bf16):
    x, w_t, offs, g = grouped_inputs([10, 0, 45, 0], 64, 64, seed=1200, device="cuda", trailing_tokens=23)
    inside = int(offs[-1])
    x[inside:], g[inside:] = 1e4, 1e4  # loud values: any leak would show
    out, grad_x, grad_w_t = op_grouped(x, w_t, offs, g, wgrad_bf16=wgrad_bf16, kernel="scaled_mm")
    assert not out[inside:].any() and not grad_x[inside:].any()
    assert not grad_w_t[1].any() and not grad_w_t[3].any()  # empty groups: exactly zero weight grads
    bars = SQNR_BARS if not wgrad_bf16 else (*SQNR_BARS[:2], 40.0)
    assert_sqnr(grouped_reference(x[:inside], w_t, offs, g[:inside]), (out[:inside], grad_x[:inside], grad_w_t), bars,
                "cuda grouped with trailing tokens")


@needs_sm90
def test_compiled_inductor_on_cuda_equals_eager():
    x, w, _ = linear_inputs((2, 64, 256), 128, seed=1300, device="cuda")
    _, w_t, offs, g = grouped_inputs([40, 0, 88], 128, 64, seed=1301, device="cuda")

    def block(a, b, c):
        h = ops.fp8_rowwise_linear(a, b, None, False, "scaled_mm")
        return ops.fp8_rowwise_grouped_mm(torch.relu(h).reshape(-1, 128), c, offs, False, "scaled_mm")

    torch._dynamo.reset()
    got = forward_backward(torch.compile(block, backend="inductor", fullgraph=True), g, x, w, w_t)
    want = forward_backward(block, g, x, w, w_t)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---- the debug model trained under the fp8_rowwise recipe ------------------------------------------------


@needs_sm90
def test_debug_model_loss_after_50_steps_within_3_percent_of_bf16_on_the_real_kernels():
    import moepass
    from moepass.harness.corpus import Batches, load_corpus
    from moepass.models import build_model
    from moepass.harness.train import train

    torch.manual_seed(0)
    base = build_model("debug").cuda()
    train_tokens, _ = load_corpus(limit_bytes=1 << 20)
    batches = Batches(train_tokens, batch_size=8, seq_len=128, seed=0)
    final = {}
    for name, backend, options in (("bf16", "inductor", None), ("fp8_rowwise", "moepass", {"recipe": "fp8_rowwise"})):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        kwargs = {"options": options} if options else {}
        with moepass.collecting() as report:
            results = train(model, torch.compile(model, backend=backend, **kwargs), batches, 50,
                            torch.device("cuda"), lr=3e-3)
        assert all(math.isfinite(r.loss) for r in results)
        final[name] = sum(r.loss for r in results[-5:]) / 5
        if backend == "moepass":
            kernels = {k for p in report.to_dict()["passes"] if p["name"] in ("linear", "grouped_mm")
                       for k in p["implementations"]}
            assert "scaled_mm" in kernels and "emulated" not in kernels, kernels
    assert final["bf16"] < 6.0, f"BF16 baseline did not learn: {final}"
    assert abs(final["fp8_rowwise"] - final["bf16"]) / final["bf16"] <= 0.03, final


@needs_sm90
@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_compiled_model_with_bf16_expert_wgrad_trains_on_unaligned_token_groups(recipe):
    """The grouped BF16 wgrad written inline in the backward hit torch._grouped_mm's alignment assert once
    Inductor chose its layouts (16B model, 2xH200); the opaque moepass::grouped_mm_wgrad_bf16 fixes them."""
    from moepass.harness.corpus import Batches, load_corpus
    from moepass.models import build_model
    from moepass.harness.train import train

    torch.manual_seed(0)
    model = build_model("debug").cuda()
    train_tokens, _ = load_corpus(limit_bytes=1 << 20)
    batches = Batches(train_tokens, batch_size=4, seq_len=127, seed=0)  # 508 tokens: groups of any size
    torch._dynamo.reset()
    options = {"recipe": recipe, f"{'mxfp8' if recipe == 'mxfp8' else 'fp8_rowwise'}.wgrad_bf16": True}
    results = train(model, torch.compile(model, backend="moepass", options=options), batches, 3,
                    torch.device("cuda"), lr=1e-3)
    torch.cuda.synchronize()
    assert all(math.isfinite(r.loss) for r in results), [r.loss for r in results]


# ---- the decomposed ops under Inductor (what the moepass backend compiles) -----------------------------

def _compiled_with_decompositions(fn, sink, expert_weights_once=False, linear_both_layouts="none"):
    from torch._inductor.compile_fx import compile_fx

    from moepass.inductor_stage.cache_key import CompiledGraphAudit
    from moepass.ops.lowp.fp8_rowwise.decomp import inductor_decompositions

    audit = CompiledGraphAudit(sink, variant=f"{expert_weights_once}-{linear_both_layouts}")

    def backend(gm, example_inputs):
        # caches off: on a cache hit (an earlier run on this machine) Inductor skips its passes, the audit among them
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": audit,
                                                              "force_disable_caches": True},
                          decompositions=inductor_decompositions(expert_weights_once, linear_both_layouts))

    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


@needs_fp8
@pytest.mark.parametrize("shape", [(64, 48), (1000, 256), (4096, 2048)])
def test_inductor_fused_quantization_equals_eager_bit_for_bit(shape):
    from moepass.ops.lowp.fp8_rowwise import decomp

    t = _wide_range(shape, seed=shape[0] + 1)
    for fn in (decomp.rows, decomp.cols):
        torch._dynamo.reset()
        q, scale = torch.compile(fn, backend="inductor", fullgraph=True)(t)
        ref_q, ref_scale = fn(t)
        assert q.stride() == ref_q.stride() and torch.equal(scale, ref_scale), fn.__name__
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), fn.__name__


@needs_fp8
@pytest.mark.parametrize("case", [0, 1, 3, 4])
def test_compiled_decomposed_linear_matches_eager_and_clears_bars(case):
    x_shape, n = LINEAR_SHAPES[case]
    x, w, g = linear_inputs(x_shape, n, seed=1400 + case, device="cuda")
    audit = []
    fn = _compiled_with_decompositions(lambda a, b: ops.fp8_rowwise_linear(a, b, None, False, "scaled_mm"), audit)
    got = forward_backward(fn, g, x, w)
    want = op_linear(x, w, g, kernel="scaled_mm")
    for name, a, b in zip(("out", "grad input", "grad weight"), got, want):
        assert a.shape == b.shape and sqnr(b, a) >= CLOSE_TO_EMULATED_DB, (name, sqnr(b, a))
    assert_sqnr(linear_reference(x, w, g), got, SQNR_BARS, f"compiled linear {x_shape} N={n}")
    graphs = {c["kind"]: c["ops"] for c in audit}
    assert graphs["forward"] == {"aten._scaled_mm": 1} and graphs["backward"] == {"aten._scaled_mm": 2}, graphs


@needs_sm90
@pytest.mark.parametrize("case", range(len(GROUPED_SHAPES)))
def test_compiled_decomposed_grouped_matches_eager_and_clears_bars(case):
    sizes, k, n = GROUPED_SHAPES[case]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=1500 + case, device="cuda", trailing_tokens=5)
    audit = []
    fn = _compiled_with_decompositions(lambda a, b, o: ops.fp8_rowwise_grouped_mm(a, b, o, False, "scaled_mm"), audit)
    got = forward_backward(fn, g, x, w_t, offs)
    want = op_grouped(x, w_t, offs, g, kernel="scaled_mm")
    for name, a, b in zip(("out", "grad input", "grad weight"), got, want):
        assert a.shape == b.shape and a.stride() == b.stride(), name
        assert sqnr(b, a) >= CLOSE_TO_EMULATED_DB, (name, sqnr(b, a))
    inside = int(offs[-1])
    assert not got[0][inside:].any() and not got[1][inside:].any()  # trailing tokens: zero, as the op gives
    assert_sqnr(grouped_reference(x[:inside], w_t, offs, g[:inside]), (got[0][:inside], got[1][:inside], got[2]),
                SQNR_BARS, f"compiled grouped {sizes} K={k} N={n}")
    graphs = {c["kind"]: c["ops"] for c in audit}
    # the wgrad decomposed: its two operands' token-group quantizations and the 2d-2d GEMM. The partitioner may
    # quantize x in the forward and save it in FP8 (half of x's bytes) instead of x: count the graphs together.
    counted = ("aten._scaled_grouped_mm", "moepass.fp8_rowwise_token_group_cols",
               "moepass.fp8_rowwise_grouped_mm_wgrad")
    in_both = {op: graphs["forward"].get(op, 0) + graphs["backward"].get(op, 0) for op in counted}
    assert in_both == dict(zip(counted, (3, 2, 0))), graphs
    assert graphs["backward"]["aten._scaled_grouped_mm"] == 2, graphs


# ---- fp8_rowwise.expert_weights_once: the Triton kernels and the compiled grouped GEMM -----------------

@needs_fp8
@pytest.mark.parametrize("shape", [(4, 96, 64), (3, 200, 136), (64, 1408, 2048)])
@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_expert_weights_kernels_equal_the_reference_bit_for_bit(shape, layout):
    from moepass.ops.lowp.fp8_rowwise import decomp

    e, n, k = shape
    w = (torch.randn(e, n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    w_t = w.transpose(-2, -1) if layout == "transposed" else w.transpose(-2, -1).contiguous()
    got = ops.fp8_rowwise_expert_weights(w_t)
    for name, out, ref in zip(("fwd q", "fwd scale", "dgrad q", "dgrad scale"), got,
                              (*decomp.cols(w_t), *decomp.rows(w_t))):
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        if 1 not in out.shape:  # a size-1 dim's stride carries no layout
            assert out.stride() == ref.stride(), name
        assert torch.equal(out.float(), ref.float()), name


@needs_sm90
def test_compiled_grouped_with_expert_weights_once_equals_the_default():
    sizes, k, n = GROUPED_SHAPES[-1]
    x, w_t, offs, g = grouped_inputs(sizes, k, n, seed=1600, device="cuda", trailing_tokens=5)
    runs = []
    for once in (False, True):
        audit = []
        fn = _compiled_with_decompositions(lambda a, b, o: ops.fp8_rowwise_grouped_mm(a, b, o, True, "scaled_mm"),
                                           audit, expert_weights_once=once)
        runs.append((forward_backward(fn, g, x, w_t, offs), {c["kind"]: c["ops"] for c in audit}))
    for name, a, b in zip(("out", "grad input", "grad weight"), runs[0][0], runs[1][0]):
        assert torch.equal(a, b), name
    assert runs[1][1]["forward"].get("moepass.fp8_rowwise_expert_weights") == 1, runs[1][1]
    assert "moepass.fp8_rowwise_expert_weights" not in runs[1][1]["backward"], runs[1][1]



# ---- fp8_rowwise.linear_both_layouts: a linear operand's rows and columns from one op -----------------

@needs_fp8
@pytest.mark.parametrize("shape", [(64, 48), (1000, 256), (4096, 2048), (16384, 1536), (32784, 65600)])
def test_rows_and_cols_kernels_equal_the_reference_bit_for_bit(shape):
    """The last shape has more than 2^31 elements: the kernels index in 64 bits."""
    from moepass.ops.lowp.fp8_rowwise import decomp

    t = _wide_range(shape, seed=shape[0] + 7)
    got = ops.fp8_rowwise_rows_and_cols(t)
    for name, out, ref in zip(("rows q", "rows scale", "cols q", "cols scale"), got, (*decomp.rows(t), *decomp.cols(t))):
        assert out.shape == ref.shape and out.dtype == ref.dtype, name
        if 1 not in out.shape:
            assert out.stride() == ref.stride(), name
        assert torch.equal(out.view(torch.uint8) if out.dtype != torch.float32 else out,
                           ref.view(torch.uint8) if ref.dtype != torch.float32 else ref), name
        del out, ref


@needs_fp8
@pytest.mark.parametrize("both", ["grads", "grads_and_inputs"])
def test_compiled_linears_with_both_layouts_equal_the_default(both):
    x, w1, _ = linear_inputs((2, 1000, 1024), 512, seed=1700, device="cuda")
    _, w2, g = linear_inputs((2, 1000, 512), 768, seed=1701, device="cuda")

    def two_linears(x, w1, w2):
        h = ops.fp8_rowwise_linear(x, w1, None, False, "scaled_mm")
        return ops.fp8_rowwise_linear(torch.relu(h), w2, None, False, "scaled_mm")

    runs = {}
    for option in ("none", both):
        audit = []
        fn = _compiled_with_decompositions(two_linears, audit, linear_both_layouts=option)
        runs[option] = (forward_backward(fn, g, x, w1, w2), {c["kind"]: c["ops"] for c in audit})
    for name, a, b in zip(("out", "grad x", "grad w1", "grad w2"), runs["none"][0], runs[both][0]):
        assert torch.equal(a, b), name
    graphs = runs[both][1]
    assert graphs["backward"].get("moepass.fp8_rowwise_rows_and_cols") == 2, graphs  # each linear's grad_out
    assert graphs["forward"].get("moepass.fp8_rowwise_rows_and_cols", 0) == (2 if both == "grads_and_inputs" else 0)
    assert graphs["backward"]["aten._scaled_mm"] == 4 and graphs["forward"]["aten._scaled_mm"] == 2, graphs


# ---- rows received by expert parallelism: a data-dependent row count, maybe 0 ---------------------------

def _received_rows_mm(x_all, keep, group_of_row, w_t, kernel):
    index = keep.nonzero().squeeze(-1)  # unbacked row count, as after an EP exchange
    groups = group_of_row[index]
    counts = torch.zeros(w_t.shape[0], dtype=torch.int64, device=x_all.device).scatter_add(
        0, groups, torch.ones_like(groups))
    return ops.fp8_rowwise_grouped_mm(x_all[index], w_t, counts.cumsum(0).to(torch.int32), True, kernel)


@needs_sm90
@pytest.mark.parametrize("kept", [0.7, 0.0])
def test_compiled_grouped_on_data_dependent_rows_keeps_the_op_and_equals_eager(kept):
    """Where the row count is unbacked (rows received in an EP exchange) the grouped op stays opaque (decomposed it
    measured slower: examples/results/received_rows_h200/): compiled, it gives the eager op's numbers, also when
    no row arrives."""
    x_all, w_t, _, _ = grouped_inputs([300, 500, 200, 24], 256, 128, seed=1700, device="cuda")
    group_of_row = torch.arange(1024, device="cuda") * 4 // 1024
    keep = torch.rand(1024, device="cuda", generator=torch.Generator("cuda").manual_seed(5)) < kept
    audit = []
    fn = _compiled_with_decompositions(lambda *a: _received_rows_mm(*a, "scaled_mm"), audit)
    leaf = x_all.clone().requires_grad_(True)
    with torch._inductor.config.patch(force_disable_caches=True):  # both cases compile: the audit sees both
        out = fn(leaf, keep, group_of_row, w_t)
        g = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16)
        out.backward(g)
    eager_leaf = x_all.clone().requires_grad_(True)
    want = _received_rows_mm(eager_leaf, keep, group_of_row, w_t, "scaled_mm")
    want.backward(g)
    assert out.shape == want.shape and out.shape[0] == int(keep.sum())
    if out.shape[0]:
        assert sqnr(want, out) >= CLOSE_TO_EMULATED_DB and sqnr(eager_leaf.grad, leaf.grad) >= CLOSE_TO_EMULATED_DB
    assert not leaf.grad[~keep].any()
    graphs = {c["kind"]: c["ops"] for c in audit}
    assert graphs["forward"].get("moepass.fp8_rowwise_grouped_mm") == 1, graphs
    assert graphs["backward"].get("moepass.fp8_rowwise_grouped_mm_dgrad") == 1, graphs
