"""moepass/ops/lowp/fp8_rowwise/decomp.py on CPU: the FP8-rowwise ops' "scaled_mm" kernel as plain torch.

torch._scaled_mm has a CPU kernel, so the linear's decomposition runs for real here (kernel choice
patched to allow "scaled_mm" on CPU). torch._scaled_grouped_mm has none: a CPU stand-in that checks
the CUDA kernel's layout and scale-shape rules takes its place. Power-of-two scales make every result
bit-equal to the emulated kernel. GPU counterparts: tests/gpu/test_fp8_rowwise_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import moepass
import moepass.ops  # noqa: F401  (registers the ops)
from moepass.inductor_stage.cache_key import CompiledGraphAudit
from moepass.ops.lowp.fp8_rowwise import decomp, quant
from helpers import (assert_all_equal, forward_backward, grouped_inputs, linear_inputs, recording_aot_backend,
                     two_linears_per_kernel)
from helpers import fp8_rowwise_op_grouped as op_grouped
from helpers import fp8_rowwise_op_linear as op_linear
from helpers import scaled_grouped_mm_on_cpu, scaled_mm_on_cpu  # noqa: F401  (fixtures)

ops = torch.ops.moepass
BF16 = torch.bfloat16
FP8_OPS = {getattr(ops, name).default for name in (
    "fp8_rowwise_linear", "fp8_rowwise_linear_dgrad", "fp8_rowwise_linear_wgrad",
    "fp8_rowwise_grouped_mm", "fp8_rowwise_grouped_mm_dgrad", "fp8_rowwise_grouped_mm_wgrad")}


def _counting_backend(op, counts: dict, **table_options):
    """aot_autograd with moepass's table, partitioned as Inductor partitions; counts `op` per graph ("fw", "bw")."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def record(kind):
        def compiler(gm, example_inputs):
            counts[kind] = sum(n.target == op for n in gm.graph.nodes)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=record("fw"), bw_compiler=record("bw"),
                        decompositions=decomp.fp8_rowwise_decompositions(**table_options),
                        partition_fn=min_cut_rematerialization_partition)


# ---- the table ----------------------------------------------------------------------------------

def test_table_covers_the_six_ops():
    table = decomp.fp8_rowwise_decompositions()
    # and quantize_once's quantization, GEMM and wgrad on quantized rows (tests/integration/test_quantize_once.py)
    assert set(table) == FP8_OPS | {torch.ops.moepass.fp8_rowwise_quantize_rows.default,
                                    torch.ops.moepass.fp8_rowwise_grouped_mm_on_rows.default,
                                    torch.ops.moepass.fp8_rowwise_grouped_mm_wgrad_on_rows.default}
    merged = decomp.inductor_decompositions()
    assert set(table) <= set(merged) and torch.ops.aten.addmm.default in merged  # Inductor's own table kept


def test_emulated_kernel_is_not_decomposed():
    x, w, g = linear_inputs((32, 64), 48, seed=1)
    xg, w_t, offs, gg = grouped_inputs([10, 22], 64, 48, seed=2)
    table = decomp.fp8_rowwise_decompositions()
    calls = {ops.fp8_rowwise_linear.default: (x, w, None, False, "emulated"),
             ops.fp8_rowwise_linear_dgrad.default: (g, w, "emulated"),
             ops.fp8_rowwise_linear_wgrad.default: (g, x, "emulated"),
             ops.fp8_rowwise_grouped_mm.default: (xg, w_t, offs, False, "emulated"),
             ops.fp8_rowwise_grouped_mm_dgrad.default: (gg, w_t, offs, "emulated"),
             ops.fp8_rowwise_grouped_mm_wgrad.default: (gg, xg, offs, "emulated")}
    for op, args in calls.items():
        assert table[op](*args) is NotImplemented, op


def test_token_counts_that_may_be_zero_keep_the_op():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    assert decomp._maybe_empty(0) and not decomp._maybe_empty(16)
    assert decomp._maybe_empty(ShapeEnv().create_unbacked_symint())  # e.g. tokens received by expert parallelism


# ---- numerics: bit-equal to the emulated kernel ----------------------------------------------------

LINEAR_CASES = [((64, 64), 96), ((2, 25, 128), 64), ((7, 32), 32), ((3, 5, 48), 16)]  # tokens % 16 != 0 too


@pytest.mark.parametrize("x_shape, n", LINEAR_CASES)
def test_linear_scaled_mm_equals_emulated_bit_for_bit(scaled_mm_on_cpu, x_shape, n):
    x, w, g = linear_inputs(x_shape, n, seed=sum(x_shape) + n)
    want = op_linear(x, w, g, kernel="emulated")
    assert_all_equal(op_linear(x, w, g, kernel="scaled_mm"), want, f"eager op {x_shape}")
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, n)
    direct = (decomp.linear(x, w, None), decomp.linear_dgrad(g, w), decomp.linear_wgrad(g2, x2))
    assert_all_equal(direct, want, f"decomposition {x_shape}")


def test_linear_bias_and_zero_tokens(scaled_mm_on_cpu):
    x, w, g = linear_inputs((2, 20, 64), 32, seed=3)
    bias = torch.randn(32).to(BF16)
    fn = lambda kernel: lambda a, b, c: ops.fp8_rowwise_linear(a, b, c, False, kernel)  # noqa: E731
    got = forward_backward(fn("scaled_mm"), g, x, w, bias)
    want = forward_backward(fn("emulated"), g, x, w, bias)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    x, w, g = linear_inputs((0, 64), 32, seed=4)
    out, grad_x, grad_w = op_linear(x, w, g, kernel="scaled_mm")
    assert out.shape == (0, 32) and grad_x.shape == (0, 64) and not grad_w.any()


def test_operand_layouts():
    t = torch.randn(48, 32).to(BF16)
    q, scale = decomp.rows(t)
    assert q.is_contiguous() and scale.shape == (48, 1)
    q, scale = decomp.cols(t)
    assert q.t().is_contiguous() and scale.shape == (1, 32)  # column-major, as the right operand is read
    w_t = torch.randn(4, 48, 32).to(BF16).transpose(-2, -1)  # [E, K=32, N=48], as models pass it
    q, scale = decomp.cols(w_t)
    assert q.stride(1) == 1 and scale.shape == (4, 1, 48)
    assert decomp.pad_tokens(torch.ones(20, 16)).shape == (32, 16) and decomp.pad_tokens(t) is t


@pytest.mark.parametrize("sizes, trailing", [([10, 0, 50, 40], 0), ([33, 31, 1, 0], 7), ([5], 3)])
def test_grouped_scaled_mm_equals_emulated_bit_for_bit(scaled_grouped_mm_on_cpu, sizes, trailing):
    x, w_t, offs, g = grouped_inputs(sizes, 64, 48, seed=sum(sizes), trailing_tokens=trailing)
    out, grad_x, _ = op_grouped(x, w_t, offs, g, kernel="emulated")
    assert torch.equal(decomp.grouped_mm(x, w_t, offs), out)  # rows past offs[-1]: zero, not the stand-in's NaN
    assert torch.equal(decomp.grouped_mm_dgrad(g, w_t, offs), grad_x)


@pytest.mark.parametrize("weights_once", [False, True])
def test_rows_form_decomposition_equals_emulated_bit_for_bit(scaled_grouped_mm_on_cpu, weights_once):
    """quantize_once's ops (ops/lowp/grouped_mm_rows.py) for kernel "scaled_mm": the rows' quantization in plain torch
    and the GEMM on quantized rows, bit-equal to the emulated ops."""
    x, w_t, offs, _ = grouped_inputs([10, 0, 50, 40], 64, 48, seed=4, trailing_tokens=7)
    table = decomp.fp8_rowwise_decompositions(expert_weights_once=weights_once)
    ops = torch.ops.moepass
    q, scale = ops.fp8_rowwise_quantize_rows(x, "emulated")
    assert_all_equal(table[ops.fp8_rowwise_quantize_rows.default](x, "scaled_mm"), (q, scale), "quantize_rows")
    want = ops.fp8_rowwise_grouped_mm_on_rows(q, scale, w_t, offs, "emulated")
    assert torch.equal(table[ops.fp8_rowwise_grouped_mm_on_rows.default](q, scale, w_t, offs, "scaled_mm"), want)
    assert torch.equal(want, ops.fp8_rowwise_grouped_mm(x, w_t, offs, False, "emulated"))


@pytest.mark.parametrize("sizes, trailing", [([10, 0, 50, 40], 7), ([100, 33, 0, 0, 17], 3), ([0, 0, 5], 0)])
def test_token_group_cols_op_writes_the_padded_wgrad_layout(sizes, trailing):
    """The op's CPU body (the layout the CUDA kernel writes, tests/gpu/test_fp8_rowwise_gpu.py) against the reference."""
    x, _, offs, _ = grouped_inputs(sizes, 96, 16, seed=len(sizes), trailing_tokens=trailing)
    q_t, scale, padded_ends = ops.fp8_rowwise_token_group_cols(x, offs)
    ref_q, ref_scale = quant.token_group_cols(x, offs)
    padded = [max(-(-s // 16) * 16, 16) for s in sizes]
    assert padded_ends.tolist() == torch.tensor(padded).cumsum(0).tolist() and torch.equal(scale, ref_scale)
    begin = padded_begin = 0
    for size, padded_size in zip(sizes, padded):
        block = q_t[:, padded_begin:padded_begin + padded_size].view(torch.uint8)
        assert torch.equal(block[:, :size], ref_q[begin:begin + size].t().view(torch.uint8))
        assert not block[:, size:].any()  # zero padding: adds nothing to the wgrad
        begin, padded_begin = begin + size, padded_begin + padded_size
    torch.library.opcheck(ops.fp8_rowwise_token_group_cols.default, (x, offs))


def test_grouped_wgrad_decomposition_is_the_op(scaled_grouped_mm_on_cpu):
    x, _, offs, g = grouped_inputs([20, 0, 27, 9], 64, 48, seed=21, trailing_tokens=3)
    got = decomp.grouped_mm_wgrad(g, x, offs)
    assert got.shape == (4, 64, 48) and got.stride() == (64 * 48, 1, 64)  # column-major, like w_t
    assert torch.equal(got, ops.fp8_rowwise_grouped_mm_wgrad(g, x, offs, "scaled_mm"))
    emulated = ops.fp8_rowwise_grouped_mm_wgrad(g, x, offs, "emulated")
    assert (got.float() - emulated.float()).abs().max() <= 2e-2 * emulated.float().abs().max()  # bf16 sums


def test_w1_and_w3_wgrads_share_one_quantization_of_x(scaled_grouped_mm_on_cpu):
    """An MoE's w1 and w3 read the same tokens: their FP8 wgrads' two quantizations of x are CSE'd into one."""
    x, w1_t, offs, _ = grouped_inputs([20, 0, 27], 64, 48, seed=22, trailing_tokens=3)
    _, w3_t, _, g = grouped_inputs([20, 0, 27], 64, 48, seed=23, trailing_tokens=3)

    def mlp(x, w1_t, w3_t, offs, kernel="scaled_mm"):  # SiLU(x @ w1) * (x @ w3), as torchtitan's GroupedExperts
        up = ops.fp8_rowwise_grouped_mm(x, w1_t, offs, False, kernel)
        return torch.nn.functional.silu(up) * ops.fp8_rowwise_grouped_mm(x, w3_t, offs, False, kernel)

    counts = {}
    backend = _counting_backend(ops.fp8_rowwise_token_group_cols.default, counts)
    torch._dynamo.reset()
    got = forward_backward(torch.compile(mlp, backend=backend, fullgraph=True), g, x, w1_t, w3_t, offs)
    assert counts["fw"] + counts["bw"] == 3  # grad_up, grad_gate and x: not 4 (x's may move to the forward)
    emulated = forward_backward(lambda *a: mlp(*a, kernel="emulated"), g, x, w1_t, w3_t, offs)
    assert_all_equal(got[:4], emulated[:4], "w1/w3 fwd and grads")


# ---- AOTAutograd applies the table: forward op and the backward ops its autograd calls --------------

def _graphs_backend(graphs):
    return recording_aot_backend(graphs, decomp.fp8_rowwise_decompositions())


def _block(x, w, w_t, offs, kernel):
    h = ops.fp8_rowwise_linear(x, w, None, True, kernel)  # wgrad_bf16: the grouped wgrad has no CPU kernel
    return ops.fp8_rowwise_grouped_mm(torch.relu(h).reshape(-1, h.shape[-1]), w_t, offs, True, kernel)


def test_aot_graphs_hold_scaled_mm_and_no_fp8_op(scaled_grouped_mm_on_cpu):
    x, w, _ = linear_inputs((2, 25, 64), 64, seed=5)
    _, w_t, offs, g = grouped_inputs([20, 0, 27], 64, 48, seed=6, trailing_tokens=3)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _block(*a, "scaled_mm"), backend=_graphs_backend(graphs), fullgraph=True)
    got = forward_backward(compiled, g, x, w, w_t, offs)
    aten = torch.ops.aten
    assert {aten._scaled_mm.default, aten._scaled_grouped_mm.default} <= graphs["fw"]
    assert {aten._scaled_mm.default, aten._scaled_grouped_mm.default} <= graphs["bw"]  # the two dgrads
    assert not (graphs["fw"] | graphs["bw"]) & FP8_OPS
    assert_all_equal(got[:3], forward_backward(lambda *a: _block(*a, "emulated"), g, x, w, w_t, offs)[:3], "block")


def test_emulated_graphs_keep_the_ops():
    x, w, _ = linear_inputs((32, 64), 64, seed=7)
    _, w_t, offs, g = grouped_inputs([12, 20], 64, 48, seed=8)
    graphs = {}
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _block(*a, "emulated"), backend=_graphs_backend(graphs), fullgraph=True)
    forward_backward(compiled, g, x, w, w_t, offs)
    assert {ops.fp8_rowwise_linear.default, ops.fp8_rowwise_grouped_mm.default} <= graphs["fw"]
    assert torch.ops.aten._scaled_mm.default not in graphs["fw"] | graphs["bw"]


def test_dynamic_token_count_decomposes_once(scaled_mm_on_cpu):
    graphs = {}
    counts = []
    backend = _graphs_backend(graphs)

    def counting(gm, example_inputs):
        counts.append(1)
        return backend(gm, example_inputs)

    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: ops.fp8_rowwise_linear(x, w, None, False, "scaled_mm"), backend=counting,
                       dynamic=True)
    for m in (40, 72, 17):  # padded to 48, 80 and 32 tokens inside the graph
        x, w, _ = linear_inputs((m, 64), 32, seed=m)
        assert torch.equal(fn(x, w), ops.fp8_rowwise_linear(x, w, None, False, "emulated"))
    assert len(counts) == 1 and torch.ops.aten._scaled_mm.default in graphs["fw"]


# ---- the moepass backend hands the table to Inductor ---------------------------------------------------

def test_backend_passes_the_table_to_compile_fx(monkeypatch):
    seen = {}

    def fake_compile_fx(gm, example_inputs, **kwargs):
        seen.update(kwargs)
        return gm.forward

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    torch._dynamo.reset()
    torch.compile(torch.nn.Linear(32, 16), backend="moepass")(torch.randn(4, 32))
    table = seen["decompositions"]
    assert set(decomp.fp8_rowwise_decompositions()) <= set(table) and torch.ops.aten.addmm.default in table
    post_grad = seen["config_patches"]["post_grad_custom_post_pass"]  # the segment sums, then the audit
    assert isinstance(post_grad.audit, CompiledGraphAudit) and post_grad.segment_sum_devices == ("cuda",)


def test_inductor_through_the_backend_runs_scaled_mm_bit_equal_to_emulated(scaled_mm_on_cpu):
    results, audits = two_linears_per_kernel("fp8_rowwise", ("scaled_mm", "emulated"), 64, 96)
    # `up` is rewritten (`down`, the last linear, is left alone as an output head): its three GEMMs in FP8
    fp8 = audits["scaled_mm"]
    assert fp8["forward"].get("aten._scaled_mm") == 1 and fp8["backward"].get("aten._scaled_mm") == 1  # wgrad
    both_layouts = "moepass.fp8_rowwise_rows_and_cols"  # the *_both_layouts / *_weights_once kernel (auto: on)
    assert not any(op.startswith("moepass.") and op != both_layouts for ops_ in fp8.values() for op in ops_), fp8
    assert audits["emulated"]["forward"].get("moepass.fp8_rowwise_linear") == 1
    for a, b in zip(results["scaled_mm"], results["emulated"]):
        assert torch.equal(a, b)


# ---- fp8_rowwise.expert_weights_once: one quantization of each expert weight, shared by fwd and dgrad ----

@pytest.mark.parametrize("layout", ["transposed", "contiguous"])
def test_expert_weights_op_is_cols_and_rows_of_the_weight(layout):
    _, w_t, _, _ = grouped_inputs([5, 9], 64, 48, seed=11)
    if layout == "contiguous":
        w_t = w_t.contiguous()
    got = ops.fp8_rowwise_expert_weights(w_t)
    for out, ref in zip(got, (*decomp.cols(w_t), *decomp.rows(w_t))):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert torch.equal(out.float(), ref.float())
    assert got[0].transpose(-2, -1).is_contiguous() and got[2].is_contiguous()  # the layouts the GEMMs take
    torch.library.opcheck(ops.fp8_rowwise_expert_weights.default, (w_t,))


def test_expert_weights_once_quantizes_each_weight_once_in_the_forward(scaled_grouped_mm_on_cpu):
    """Both decompositions call the op on the same weight; the partitioner's CSE keeps one call, in the forward,
    and saves the dgrad half for the backward. Results equal the default table's bit for bit."""
    x, w_t, offs, g = grouped_inputs([20, 0, 27], 64, 48, seed=12, trailing_tokens=3)
    runs = {}
    for once in (False, True):
        counts = {}
        backend = _counting_backend(ops.fp8_rowwise_expert_weights.default, counts, expert_weights_once=once)
        torch._dynamo.reset()
        fn = torch.compile(lambda x, w_t, offs: ops.fp8_rowwise_grouped_mm(x, w_t, offs, True, "scaled_mm"),
                           backend=backend, fullgraph=True)
        runs[once] = (forward_backward(fn, g, x, w_t, offs), counts)
    assert runs[False][1] == {"fw": 0, "bw": 0}
    assert runs[True][1] == {"fw": 1, "bw": 0}
    assert_all_equal(runs[True][0][:3], runs[False][0][:3], "grouped fwd and grads")


def test_expert_weights_once_is_part_of_the_compile_cache_key():
    # the decomposition table is in no cache key: the option reaches Inductor's through the audit pass's uuid
    assert CompiledGraphAudit(variant="expert_weights_once").uuid() != CompiledGraphAudit().uuid()


# ---- fp8_rowwise.linear_both_layouts: a linear's gradient (and input) quantized once for both its GEMMs ----

def test_rows_and_cols_op_is_rows_and_cols_of_the_operand():
    t = torch.randn(40, 48).to(BF16)
    got = ops.fp8_rowwise_rows_and_cols(t)
    for out, ref in zip(got, (*decomp.rows(t), *decomp.cols(t))):
        assert out.shape == ref.shape and out.dtype == ref.dtype and out.stride() == ref.stride()
        assert torch.equal(out.float(), ref.float())
    torch.library.opcheck(ops.fp8_rowwise_rows_and_cols.default, (t,))


def _two_linears(x, w1, w2, kernel="scaled_mm"):  # the gradient between them feeds w1's dgrad and wgrad
    h = ops.fp8_rowwise_linear(x, w1, None, False, kernel)
    return ops.fp8_rowwise_linear(torch.relu(h), w2, None, False, kernel)


@pytest.mark.parametrize("both, where", [("none", {"fw": 0, "bw": 0}), ("grads", {"fw": 0, "bw": 2}),
                                         ("grads_and_inputs", {"fw": 2, "bw": 2})])
def test_linear_both_layouts_quantizes_each_operand_once(scaled_mm_on_cpu, both, where):
    """dgrad and wgrad call the op on the same grad_out, forward and wgrad on the same x: CSE keeps one call per
    operand (x's in the forward, its column half saved), and the results are the default table's bit for bit."""
    x, w1, _ = linear_inputs((2, 24, 64), 96, seed=31)
    _, w2, g = linear_inputs((2, 24, 96), 48, seed=32)
    counts = {}
    backend = _counting_backend(ops.fp8_rowwise_rows_and_cols.default, counts, linear_both_layouts=both)
    torch._dynamo.reset()
    got = forward_backward(torch.compile(_two_linears, backend=backend, fullgraph=True), g, x, w1, w2)
    assert counts == where  # grads: both linears' grad_out; inputs: x and relu(h)
    assert_all_equal(got, forward_backward(lambda *a: _two_linears(*a, kernel="emulated"), g, x, w1, w2),
                     f"two linears, {both}")


def test_linear_weights_once_quantizes_each_weight_once_in_the_forward(scaled_mm_on_cpu):
    """fp8_rowwise.linear_weights_once: forward and dgrad call the op on the same weight; CSE keeps one call per
    weight, in the forward (its column half saved for the dgrad); results equal the default table's bit for bit."""
    x, w1, _ = linear_inputs((2, 24, 64), 96, seed=34)
    _, w2, g = linear_inputs((2, 24, 96), 48, seed=35)
    counts = {}
    backend = _counting_backend(ops.fp8_rowwise_rows_and_cols.default, counts, linear_weights_once=True)
    torch._dynamo.reset()
    got = forward_backward(torch.compile(_two_linears, backend=backend, fullgraph=True), g, x, w1, w2)
    assert counts == {"fw": 2, "bw": 0}  # w1's and w2's
    assert_all_equal(got, forward_backward(lambda *a: _two_linears(*a, kernel="emulated"), g, x, w1, w2),
                     "two linears, weights once")


def test_linear_both_layouts_leaves_inputs_alone_under_a_bf16_wgrad(scaled_mm_on_cpu):
    x, w, _ = linear_inputs((32, 64), 48, seed=33)
    table = decomp.fp8_rowwise_decompositions(linear_both_layouts="grads_and_inputs")
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x, w: table[ops.fp8_rowwise_linear.default](x, w, None, True, "scaled_mm"))(x, w)
    assert not any(n.target == ops.fp8_rowwise_rows_and_cols.default for n in graph.graph.nodes)


def test_linear_both_layouts_keeps_plain_rows_where_tokens_may_be_zero():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._python_dispatch import TorchDispatchMode

    called = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            called.add(func)
            return func(*args, **(kwargs or {}))

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        g = torch.empty(shape_env.create_unbacked_symint(), 48, dtype=BF16)  # e.g. rows an EP dispatch received
        with Record():
            q, scale = decomp.rows_of(g, True)  # no column amax over what may be no rows
    assert ops.fp8_rowwise_rows_and_cols.default not in called and torch.ops.aten.amax.default in called
    assert q.dtype == torch.float8_e4m3fn and scale.shape[1] == 1


def test_linear_both_layouts_option_reaches_the_compile_cache_key_and_needs_the_fp8_wgrad():
    from moepass.options import Config
    from moepass.recipes.registry import cache_variant

    assert cache_variant(Config.from_options({})) == ""
    variant = cache_variant(Config.from_options({"fp8_rowwise.linear_both_layouts": "grads"}))
    assert variant == "fp8_rowwise.linear_both_layouts=grads"
    both = cache_variant(Config.from_options({"fp8_rowwise.linear_weights_once": True,
                                              "fp8_rowwise.expert_weights_once": True}))
    assert both == "fp8_rowwise.expert_weights_once=True+fp8_rowwise.linear_weights_once=True"
    assert CompiledGraphAudit(variant=variant).uuid() != CompiledGraphAudit().uuid()
    with pytest.raises(ValueError, match="fp8_rowwise.wgrad_bf16"):
        Config.from_options({"fp8_rowwise.linear_both_layouts": "grads", "fp8_rowwise.wgrad_bf16": True})
