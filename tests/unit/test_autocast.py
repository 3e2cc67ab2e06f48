"""FP32 master weights under torch.autocast(dtype=torch.bfloat16): the GEMMs autocast runs in BF16 are rewritten.

The region entered inside the compiled function (enter/exit nodes in the Dynamo graph) and the one entered around the
call (none: the ambient state) both count; the op reads each FP32 weight itself (no BF16 copy in the graph) and the
gradients reach the FP32 parameters in FP32. An FP16 region and a plain FP32 graph stay as they are, with the reason.
"""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import moepass
from moepass.analysis.autocast import AutocastRegion, gemm_precision, region_for, regions_at
from moepass.analysis.bf16_operands import bf16_copy_of
from moepass.analysis.graph import op_short_name, tensor_meta
from moepass.op_registry import gemm_role
from moepass.analysis.scopes import Scope
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.options import Config
from moepass.pipeline import run_pipeline
from moepass.skips import Reason, SkipCode
from helpers import scaled_grouped_mm_on_cpu, scaled_mm_on_cpu  # noqa: F401  (fixtures)

BF16 = torch.bfloat16
_VIEWS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "getitem", "unsqueeze", "select"}


def _rewritten(fn, *args, options=None, region=None):
    """Run fn(*args) compiled by a backend that applies moepass's passes and runs the rewritten graph eagerly;
    (output, [(graph module, record)]). region: an autocast context entered around the call."""
    import moepass.ops  # noqa: F401  (registers the ops the passes target)

    seen, config = [], Config.from_options(options)

    def backend(gm, example_inputs):
        seen.append((gm, run_pipeline(gm, config)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    with region if region is not None else contextlib.nullcontext():
        out = compiled(*args)
    return out, seen


def _counts(seen) -> dict:
    """pass -> (rewritten, sorted modules left alone) over the graphs of one compile (paths from the model's top:
    a wrapper's `model.` prefix dropped)."""
    counts = {}
    for _, record in seen:
        for p in record.passes:
            done, left = counts.get(p.name, (0, []))
            counts[p.name] = (done + len(p.rewrites),
                              sorted(left + [s.module.removeprefix("model.") for s in p.skipped]))
    return counts


def _skips(seen, name: str) -> list:
    return [s for _, record in seen for p in record.passes if p.name == name for s in p.skipped]


def _fp32_parameter(node) -> bool:
    """A graph input Dynamo read from a module's parameters, held in float32."""
    value = tensor_meta(node)
    return node.op == "placeholder" and "_parameters_" in node.name and value is not None \
        and value.dtype == torch.float32


def _through_views(node):
    while node.op in ("call_function", "call_method") and op_short_name(node) in _VIEWS:
        node = node.args[0]
    return node


def _weight_operands(gm) -> list:
    """The weight operand of every moepass forward GEMM op in the graph (linear: arg 1; grouped: w_t, arg 1;
    rows form: w_t, arg 3)."""
    found = []
    for node in gm.graph.nodes:
        role = gemm_role(node.target) if node.op == "call_function" else None
        if role is not None and role.gemm == "forward":
            found.append(node.args[3] if "rows" in node.target.name() else node.args[1])
    return found


def _assert_fp32_weights_read_directly(seen) -> None:
    """Every op's weight is an FP32 parameter through views, and the graph holds no BF16 copy of one."""
    for gm, _ in seen:
        weights = [_through_views(w) for w in _weight_operands(gm)]
        assert weights
        for w in weights:
            assert _fp32_parameter(w), f"an op reads {w.format_node()}, not an FP32 parameter"
        copies = [n for n in gm.graph.nodes if bf16_copy_of(n) is not None and bf16_copy_of(n)[0] in weights]
        assert copies == [], [n.format_node() for n in copies]


# ---------------------------------------------------------------- the debug DeepSeek-V3, FP32 under autocast

# the debug model cut to one layer, a MoE layer: attention, the shared expert (the dense FFN's class), the router and
# the routed experts, every GEMM kind of the model; each extra layer only repeats them and lengthens every trace
MOE_LAYER = {"n_layers": 1, "n_dense_layers": 0}


@pytest.fixture(scope="module")
def bf16_counts():
    torch.manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    _, seen = _rewritten(build_model("debug", **MOE_LAYER), tokens)
    return _counts(seen)


class InsideAutocast(nn.Module):
    """The model's forward under a region entered inside the compiled function."""

    def __init__(self, model, dtype=BF16):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *args):
        with torch.autocast("cpu", dtype=self.dtype):
            return self.model(*args)


@pytest.mark.parametrize("where", ["inside the compiled function", "around the call"])
def test_fp32_model_under_bf16_autocast_rewrites_what_the_bf16_model_does(bf16_counts, where):
    torch.manual_seed(0)
    model = build_model("debug", **MOE_LAYER, dtype=torch.float32)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    if where == "around the call":
        out, seen = _rewritten(model, tokens, region=torch.autocast("cpu", dtype=BF16))
    else:
        out, seen = _rewritten(InsideAutocast(model), tokens)
    counts = _counts(seen)
    assert counts == bf16_counts
    # attention wq, wkv_a, wkv_b, wo + the shared expert's 3; the routed experts' w1, w3, w2; the routing weights
    # moved onto w2's input
    assert counts["linear"][0] == 7 and counts["grouped_mm"][0] == 3 and counts["weights_before_gemm"][0] == 1
    rewritten = [r for _, record in seen for p in record.passes if p.name == "linear" for r in p.rewrites]
    assert all(f"BF16 by torch.autocast('cpu', dtype=torch.bfloat16) entered {where}" in r.detail
               for r in rewritten), rewritten[0].detail
    assert all("W read in torch.float32" in r.detail for r in rewritten)
    _assert_fp32_weights_read_directly(seen)
    assert torch.isfinite(out).all()


def test_fp32_model_quantizes_expert_rows_once_before_the_gather_under_autocast():
    """fp8_rowwise has a rows form: the FP32 token rows are cast to BF16 once, quantized, then gathered."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    options = {"recipe": "fp8_rowwise"}
    _, bf16 = _rewritten(build_model("debug", **MOE_LAYER), tokens, options=options)
    _, fp32 = _rewritten(build_model("debug", **MOE_LAYER, dtype=torch.float32), tokens, options=options,
                         region=torch.autocast("cpu", dtype=BF16))
    assert _counts(fp32)["quantize_once"] == _counts(bf16)["quantize_once"]
    details = [r.detail for _, record in fp32 for p in record.passes if p.name == "quantize_once" for r in p.rewrites]
    # w1 and w3 read the gathered token rows, w2 the SwiGLU output
    assert sorted(d.split(";")[0] for d in details) == ["rows quantized before 1 gather(s) of rows"] * 2 + [
        "rows quantized where they are"], details
    (gm, _), = fp32
    quantized = [n for n in gm.graph.nodes if n.op == "call_function" and "quantize_rows" in str(n.target)]
    assert len(quantized) == 2  # w1 and w3 share one quantization of the T token rows
    sources = [q.args[0] for q in quantized]
    # the FP32 token rows cast to BF16 once, before the gather (x[idx].to(torch.bfloat16) in the model)
    assert any(s.target == "to" and tensor_meta(s.args[0]).dtype == torch.float32 for s in sources), sources


@pytest.fixture(scope="module")
def inductor_reference():
    """Two steps of the two-layer debug model (one dense, one MoE layer) in FP32 under BF16 autocast, Inductor. (One
    MoE layer alone compiles fewer kernels, but its router gate's gradient measures 17 dB against the 15 dB bar
    below; 23 dB behind a dense layer.)"""
    torch.manual_seed(0)
    model = build_model("debug", n_layers=2, dtype=torch.float32)
    return model, _train(copy.deepcopy(model), "inductor")


def _train(model, backend, options=None, inside=False, steps=2):
    """(losses, first step's gradients) of AdamW steps under torch.autocast("cpu", dtype=torch.bfloat16)."""
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_of(t):
        return next_token_loss(model(t), t)

    def loss_inside(t):
        with torch.autocast("cpu", dtype=BF16):
            return loss_of(t)

    torch._dynamo.reset()
    step = torch.compile(loss_inside if inside else loss_of, backend=backend,
                         **({"options": options} if options else {}))
    losses, grads = [], {}
    for i in range(steps):
        with torch.autocast("cpu", dtype=BF16, enabled=not inside):
            loss = step(tokens)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _sqnr(ref, out) -> float:
    ref, out = ref.double(), out.double()
    return float(20 * torch.log10(ref.norm() / (ref - out).norm()))


def _assert_within_recipe_noise(ref, got):
    (ref_losses, ref_grads), (losses, grads) = ref, got
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-2 * abs(a), (ref_losses, losses)  # measured: 1e-4 relative
    assert set(grads) == set(ref_grads)
    assert {g.dtype for g in grads.values()} == {torch.float32}  # autocast's cast-backward dtype: the parameter's
    worst = min((_sqnr(ref_grads[n], grads[n]), n) for n in ref_grads)
    assert worst[0] >= 15.0, worst  # MXFP8's dgrad/wgrad noise; measured >= 21 dB
    flat = _sqnr(torch.cat([g.flatten() for g in ref_grads.values()]), torch.cat([grads[n].flatten()
                                                                                 for n in ref_grads]))
    assert flat >= 30.0, flat  # measured 41.5 dB


def test_numerics_match_inductor_under_the_same_autocast_region_inside(inductor_reference):
    model, ref = inductor_reference
    got = _train(copy.deepcopy(model), "moepass", options={"inductor": False}, inside=True)
    _assert_within_recipe_noise(ref, got)


@pytest.mark.extended  # Inductor compiles the rewritten model too: ~30 s more on 2 cores
def test_numerics_match_inductor_under_the_same_autocast_around_the_call(inductor_reference):
    model, ref = inductor_reference
    _assert_within_recipe_noise(ref, _train(copy.deepcopy(model), "moepass"))


# ---------------------------------------------------------------- small modules


class Block(nn.Module):
    """A linear with bias, a linear whose weight the model casts itself, and torchtitan's grouped GEMM casts."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 128, bias=True)
        self.down = nn.Parameter(torch.randn(64, 128) * 0.05)
        self.experts = nn.Parameter(torch.randn(4, 64, 64) * 0.05)  # [E, N, K]

    def forward(self, x, offs):
        h = F.silu(self.up(x))
        h = F.linear(h, self.down.to(torch.bfloat16))
        routed = torch._grouped_mm(h.bfloat16(), self.experts.bfloat16().transpose(-2, -1), offs=offs)
        return routed.type_as(h).float().square().mean()


def _block_inputs():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    return x, torch.tensor([16, 32, 48, 64], dtype=torch.int32)


@pytest.mark.parametrize("inductor", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("where", ["inside the compiled function", "around the call"])
def test_block_trains_under_autocast_with_fp32_gradients(where, inductor):
    torch.manual_seed(0)
    block = Block()
    x, offs = _block_inputs()
    with torch.autocast("cpu", dtype=BF16):
        ref = block(x, offs)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad(set_to_none=True)

    mine = copy.deepcopy(block)
    torch._dynamo.reset()
    compiled = torch.compile(mine if where == "around the call" else InsideAutocast(mine), backend="moepass",
                             options={"inductor": inductor})
    around = torch.autocast("cpu", dtype=BF16) if where == "around the call" else contextlib.nullcontext()
    with moepass.collecting() as report, around:
        loss = compiled(x, offs)
    loss.backward()
    passes = {p["name"]: p for p in report.to_dict()["passes"]}
    assert passes["linear"]["replaced"] == 2 and passes["grouped_mm"]["replaced"] == 1
    assert abs(loss.item() - ref.item()) <= 0.05 * abs(ref.item())
    for name, p in mine.named_parameters():
        assert p.grad.dtype == torch.float32, name
        assert _sqnr(ref_grads[name], p.grad) >= 15.0, name


def test_block_rewrite_casts_activation_and_bias_and_reads_weights_through_their_copies():
    torch.manual_seed(0)
    x, offs = _block_inputs()
    _, seen = _rewritten(Block(), x, offs, region=torch.autocast("cpu", dtype=BF16))
    (gm, record), = seen
    passes = {p.name: p for p in record.passes}
    assert len(passes["linear"].rewrites) == 2 and len(passes["grouped_mm"].rewrites) == 1
    up, down = (n for n in gm.graph.nodes if n.op == "call_function" and "mxfp8_linear" in str(n.target))
    x_op, w_op, bias_op = up.args[:3]
    assert x_op.target == "to" and x_op.args[1] is BF16 and tensor_meta(x_op.args[0]).dtype == torch.float32
    assert bias_op.target == "to" and _fp32_parameter(bias_op.args[0])  # the cast autocast makes of the bias
    assert _fp32_parameter(w_op)
    assert _fp32_parameter(down.args[1])  # `self.down.to(torch.bfloat16)` read through: the FP32 parameter
    _assert_fp32_weights_read_directly(seen)
    details = {r.module: r.detail for r in passes["linear"].rewrites}
    assert "BF16 by torch.autocast('cpu', dtype=torch.bfloat16) entered around the call" in details["up"]


ANY_ROLE = {"lowp.keep_output_head_bf16": False}  # the last linear is no output head here: its dtype decides


class Linears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64, bias=False)
        self.b = nn.Parameter(torch.randn(64, 64) * 0.05)

    def forward(self, x):
        return (self.a(x) @ self.b.t()).float().square().mean()


@pytest.mark.parametrize("where", ["inside the compiled function", "around the call"])
def test_fp16_autocast_region_rewrites_nothing_and_says_why(where):
    x = torch.randn(32, 64)
    if where == "around the call":
        _, seen = _rewritten(Linears(), x, options=ANY_ROLE, region=torch.autocast("cpu", dtype=torch.float16))
    else:
        _, seen = _rewritten(InsideAutocast(Linears(), torch.float16), x, options=ANY_ROLE)
    assert _counts(seen)["linear"][0] == 0
    skips = _skips(seen, "linear")
    assert len(skips) == 2
    for skip in skips:
        assert skip.code is SkipCode.NOT_BF16 and skip.code.phrase in skip.reason
        assert skip.reason.startswith("autocast runs it in torch.float16, not bfloat16 (torch.autocast('cpu', "
                                      f"dtype=torch.float16) entered {where}): use torch.autocast(..., "
                                      "dtype=torch.bfloat16)"), skip.reason


def test_plain_fp32_graph_rewrites_nothing_and_names_both_fixes():
    _, seen = _rewritten(Linears(), torch.randn(32, 64), options=ANY_ROLE)
    assert _counts(seen)["linear"][0] == 0
    skips = _skips(seen, "linear")
    assert len(skips) == 2
    for skip in skips:
        assert skip.code is SkipCode.NOT_BF16 and skip.code.phrase in skip.reason
        assert "activation is torch.float32, not bfloat16, and no BF16 autocast region runs it" in skip.reason
        assert "model.to(torch.bfloat16)" in skip.reason and "torch.autocast(device_type, dtype=torch.bfloat16)" \
            in skip.reason


def test_autocast_turned_off_inside_a_bf16_region_rewrites_nothing_and_says_so():
    class Off(nn.Module):
        def __init__(self):
            super().__init__()
            self.linears = Linears()

        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return self.linears(x)

    _, seen = _rewritten(Off(), torch.randn(32, 64), options=ANY_ROLE, region=torch.autocast("cpu", dtype=BF16))
    skips = _skips(seen, "linear")
    assert _counts(seen)["linear"][0] == 0 and len(skips) == 2
    for skip in skips:
        assert skip.code is SkipCode.NOT_BF16
        assert "activation is torch.float32, not bfloat16, and autocast is off here (torch.autocast('cpu', " \
               "dtype=torch.bfloat16, enabled=False) entered inside the compiled function)" in skip.reason, skip.reason


def test_grouped_mm_on_fp32_operands_under_bf16_autocast_names_the_cast_it_needs():
    """torch._grouped_mm is on no autocast list: on FP32 operands it stays FP32 even in a BF16 region."""
    class Grouped(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 64, 64) * 0.05)

        def forward(self, x, offs):
            return torch._grouped_mm(x, self.w.transpose(-2, -1), offs=offs)

    graph = fx.Graph()
    x, w, offs = (graph.placeholder(n) for n in ("x", "w", "offs"))
    enter = graph.call_function(torch.amp.autocast_mode._enter_autocast, ("cpu", BF16, True, None))
    gemm = graph.call_function(torch._grouped_mm, (x, w), {"offs": offs})
    graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
    graph.output(gemm)
    for node, value in ((x, torch.randn(64, 64)), (w, torch.randn(4, 64, 64)), (gemm, torch.randn(64, 64))):
        node.meta["example_value"] = value  # eager CPU runs fp32 grouped GEMMs: fp32 out, as recorded
    scope = Scope(fx.GraphModule(Grouped(), graph), "", "top")
    reason = gemm_precision(gemm, scope, "torch._grouped_mm", {"activation": x, "weight": w})
    assert isinstance(reason, Reason) and reason.code is SkipCode.NOT_BF16
    assert reason.text.startswith("autocast leaves torch._grouped_mm in torch.float32, not bfloat16")
    assert "x.bfloat16(), w.bfloat16()" in reason.text


# ---------------------------------------------------------------- the ops take an FP32 weight

SETTINGS = {"mxfp8": ("rceil",), "fp8_rowwise": (), "blockwise": ()}
KERNELS = [("mxfp8", "emulated"), ("fp8_rowwise", "emulated"), ("fp8_rowwise", "scaled_mm"), ("blockwise", "emulated")]


def _kernel_on_cpu(recipe, kernel, request, grouped=False):
    if (recipe, kernel) == ("fp8_rowwise", "scaled_mm"):  # its eager grouped path is torchao's Triton kernels
        if grouped:
            pytest.skip("fp8_rowwise's eager grouped scaled_mm path needs Triton: its decomposition is tested below")
        request.getfixturevalue("scaled_mm_on_cpu")


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _run(fn, grad_out, *tensors):
    leaves = _leaves(*tensors)
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()]


@pytest.mark.parametrize("wgrad_bf16", [False, True], ids=["fp8_wgrad", "bf16_wgrad"])
@pytest.mark.parametrize("recipe, kernel", KERNELS)
def test_linear_op_quantizes_an_fp32_weight_and_gives_its_gradient_in_fp32(recipe, kernel, wgrad_bf16, request):
    _kernel_on_cpu(recipe, kernel, request)
    gen = torch.Generator().manual_seed(7)
    x, g = (torch.randn(2, 40, 128, generator=gen).to(BF16) for _ in range(2))
    w = torch.randn(128, 128, generator=gen) / 128**0.5
    op = getattr(torch.ops.moepass, f"{recipe}_linear")

    def linear(a, b):
        return op(a, b, None, *SETTINGS[recipe], wgrad_bf16, kernel)

    out, (grad_x, grad_w) = _run(linear, g, x, w)
    out_bf16, (grad_x_bf16, grad_w_bf16) = _run(linear, g, x, w.bfloat16())
    assert out.dtype == grad_x.dtype == BF16 and grad_w.dtype == torch.float32
    assert torch.equal(grad_w, grad_w_bf16.float())  # the wgrad reads no weight: its result, in the weight's dtype
    reference = x.float() @ w.t()
    assert _sqnr(reference, out) >= 20.0 and _sqnr(out_bf16, out) >= 25.0
    assert _sqnr(grad_x_bf16, grad_x) >= 25.0


def _grouped_inputs():
    gen = torch.Generator().manual_seed(8)
    x, g = (torch.randn(140, 128, generator=gen).to(BF16) for _ in range(2))
    w_t = (torch.randn(3, 128, 128, generator=gen) / 128**0.5).transpose(-2, -1)  # [E, K, N] as w.transpose
    return x, w_t, torch.tensor([40, 40, 136], dtype=torch.int32), g  # an empty group, 4 rows after the last


@pytest.mark.parametrize("wgrad_bf16", [False, True], ids=["fp8_wgrad", "bf16_wgrad"])
@pytest.mark.parametrize("recipe, kernel", KERNELS)
def test_grouped_op_quantizes_fp32_expert_weights_and_gives_their_gradient_in_fp32(recipe, kernel, wgrad_bf16,
                                                                                   request):
    _kernel_on_cpu(recipe, kernel, request, grouped=True)
    x, w_t, offs, g = _grouped_inputs()
    op = getattr(torch.ops.moepass, f"{recipe}_grouped_mm")

    def grouped(a, b):
        return op(a, b, offs, *SETTINGS[recipe], wgrad_bf16, kernel)

    out, (grad_x, grad_w_t) = _run(grouped, g, x, w_t)
    out_bf16, (grad_x_bf16, grad_w_t_bf16) = _run(grouped, g, x, w_t.bfloat16())
    assert out.dtype == grad_x.dtype == BF16 and grad_w_t.dtype == torch.float32
    assert torch.equal(grad_w_t, grad_w_t_bf16.float()) and grad_w_t.stride() == grad_w_t_bf16.stride()
    rows = slice(0, int(offs[-1]))
    assert _sqnr(out_bf16[rows], out[rows]) >= 25.0 and _sqnr(grad_x_bf16[rows], grad_x[rows]) >= 25.0


@pytest.mark.parametrize("recipe, kernel", [("fp8_rowwise", "emulated"), ("blockwise", "emulated")])
def test_rows_form_takes_fp32_expert_weights(recipe, kernel):
    """quantize_once's ops: rows quantized before their gather, an FP32 expert weight."""
    x, w_t, offs, g = _grouped_inputs()
    ops = torch.ops.moepass
    quantize, rows_op = getattr(ops, f"{recipe}_quantize_rows"), getattr(ops, f"{recipe}_grouped_mm_rows")
    grouped = getattr(ops, f"{recipe}_grouped_mm")

    def on_rows(a, b):
        q, scale = quantize(a.detach(), kernel)
        return rows_op(a, q, scale, b, offs, True, False, kernel)

    out, (grad_x, grad_w_t) = _run(on_rows, g, x, w_t)
    want, (want_x, want_w_t) = _run(lambda a, b: grouped(a, b, offs, False, kernel), g, x, w_t)
    assert grad_w_t.dtype == torch.float32
    assert torch.equal(out, want) and torch.equal(grad_x, want_x)  # bit-equal to the grouped op, as with BF16


def test_fp8_rowwise_decompositions_read_fp32_weights(scaled_grouped_mm_on_cpu):
    """The plain-torch code Inductor fuses (kernel "scaled_mm"): FP32 weights quantized as they are."""
    from moepass.ops.lowp.fp8_rowwise import decomp

    x, w_t, offs, g = _grouped_inputs()
    rows = slice(0, int(offs[-1]))
    for weights_once in (False, True):
        out = decomp.grouped_mm(x, w_t, offs, weights_once)
        assert out.dtype == BF16 and _sqnr(decomp.grouped_mm(x, w_t.bfloat16(), offs)[rows], out[rows]) >= 25.0
        grad_x = decomp.grouped_mm_dgrad(g, w_t, offs, weights_once)
        assert _sqnr(decomp.grouped_mm_dgrad(g, w_t.bfloat16(), offs)[rows], grad_x[rows]) >= 25.0
    w = w_t[0].t().contiguous()
    for weights_once in (False, True):
        assert _sqnr(decomp.linear(x, w.bfloat16(), None), decomp.linear(x, w, None, weights_once=weights_once)) \
            >= 25.0
        assert _sqnr(decomp.linear_dgrad(g, w.bfloat16()), decomp.linear_dgrad(g, w, weights_once=weights_once)) \
            >= 25.0


@pytest.mark.parametrize("kernel", ["scaled_mm", "triton"])
def test_blockwise_decompositions_read_fp32_weights(kernel):
    """The code blockwise's decompositions hand Inductor: FP32 weights in 128x128 blocks, as they are (the opaque
    GEMM ops' CPU bodies are the emulated GEMM)."""
    from moepass.ops.lowp.blockwise import grouped_mm, linear

    x, w_t, offs, g = _grouped_inputs()
    rows = slice(0, int(offs[-1]))
    for fn, tokens in ((grouped_mm.forward, x), (grouped_mm.dgrad, g)):
        got, want = fn(tokens, w_t, offs, kernel), fn(tokens, w_t.bfloat16(), offs, kernel)
        assert got.dtype == BF16 and _sqnr(want[rows], got[rows]) >= 25.0
    w = w_t[0].t().contiguous()
    assert _sqnr(linear.forward(x, w.bfloat16(), None, "scaled_mm"), linear.forward(x, w, None, "scaled_mm")) >= 25.0
    assert _sqnr(linear.dgrad(g, w.bfloat16(), "scaled_mm"), linear.dgrad(g, w, "scaled_mm")) >= 25.0


# ---------------------------------------------------------------- the regions, read from a graph


def _region_graph(device: str):
    """x -> linear (outside) -> enter(device, bf16) -> linear -> enter(cpu, enabled=False) -> linear -> exit ->
    linear -> exit."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    outside = graph.call_function(F.linear, (x, w))
    enter = graph.call_function(torch.amp.autocast_mode._enter_autocast, (device, BF16, True, None))
    inside = graph.call_function(F.linear, (outside, w))
    off = graph.call_function(torch.amp.autocast_mode._enter_autocast, (device, None, False, None))
    disabled = graph.call_function(F.linear, (inside, w))
    graph.call_function(torch.amp.autocast_mode._exit_autocast, (off,))
    after_off = graph.call_function(F.linear, (disabled, w))
    graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))
    last = graph.call_function(F.linear, (after_off, w))
    graph.output(last)
    return Scope(fx.GraphModule(nn.Module(), graph), "", "top"), (outside, inside, disabled, after_off, last)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_regions_are_read_from_enter_and_exit_nodes(device):
    scope, (outside, inside, disabled, after_off, last) = _region_graph(device)
    region = AutocastRegion(device, BF16, True, "inside the compiled function")
    assert regions_at(outside, scope) == () and regions_at(last, scope) == ()
    assert region_for(inside, scope, device) == region and region_for(after_off, scope, device) == region
    off = region_for(disabled, scope, device)
    assert off is not None and not off.enabled
    assert region_for(inside, scope, "cuda" if device == "cpu" else "cpu") is None  # another device's region


def test_ambient_region_is_read_while_live():
    scope, (outside, *_rest) = _region_graph("cpu")
    with torch.autocast("cpu", dtype=BF16):
        assert region_for(outside, scope, "cpu") == AutocastRegion("cpu", BF16, True, "around the call")
    assert region_for(outside, scope, "cpu") is None


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["inside the compiled function", "around the call"])
def test_cuda_autocast_rewrites_the_block_with_fp32_gradients(where):
    torch.manual_seed(0)
    block = Block().cuda()
    x, offs = (t.cuda() for t in _block_inputs())
    options = {"recipe": "mxfp8"}  # recipe="auto" leaves a block this small in BF16 on a GPU ("too small")
    if where == "around the call":
        out, seen = _rewritten(block, x, offs, options=options, region=torch.autocast("cuda", dtype=BF16))
    else:
        class Inside(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = block

            def forward(self, x, offs):
                with torch.autocast("cuda", dtype=BF16):
                    return self.block(x, offs)

        out, seen = _rewritten(Inside(), x, offs, options=options)
    counts = _counts(seen)
    assert counts["linear"][0] == 2 and counts["grouped_mm"][0] == 1
    _assert_fp32_weights_read_directly(seen)
    out.backward()
    assert {p.grad.dtype for p in block.parameters()} == {torch.float32}
