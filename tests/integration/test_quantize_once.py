"""quantize_once: expert rows quantized once before their gather (moepass::<recipe>_quantize_rows and
_grouped_mm_rows), bit-equal to quantizing after the gather, and FP8 rows saved for the backward."""

import pytest
import torch
import torch.nn.functional as F

import moepass
import moepass.ops.lowp  # noqa: F401  (registers the ops)
from moepass.op_registry import rows_form
from moepass.recipes.registry import RECIPES
from helpers import rank_pool  # noqa: F401  (fixture)

BF16 = torch.bfloat16
ROWS_RECIPES = ("fp8_rowwise", "blockwise")
T, K, N = 10, 128, 256
OFFS = (5, 12, 20)  # three experts; rows 20..23 belong to none (their outputs and gradients are zero)


def _problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g).to(BF16).requires_grad_()
    w_t = torch.randn(len(OFFS), N, K, generator=g).to(BF16).transpose(-2, -1).detach().requires_grad_()
    idx = torch.randint(0, T, (24,), generator=g)
    grad_out = torch.randn(24, N, generator=g).to(BF16)
    return x, w_t, idx, torch.tensor(OFFS, dtype=torch.int32), grad_out


def _grads(fn, grad_out, *leaves):
    for t in leaves:
        t.grad = None
    out = fn()
    out.backward(grad_out)
    return out.detach(), *(t.grad.clone() for t in leaves)


@pytest.mark.parametrize("saved", ["fp8", "bf16"])
@pytest.mark.parametrize("wgrad_bf16", [False, True])
@pytest.mark.parametrize("name", ROWS_RECIPES)
def test_rows_form_is_bit_equal_to_quantizing_after_the_gather(name, wgrad_bf16, saved):
    recipe = RECIPES[name]
    form = rows_form(recipe.op("grouped_mm"))
    x, w_t, idx, offs, grad_out = _problem(0)
    ref, ref_gx, ref_gw = _grads(lambda: recipe.op("grouped_mm")(x[idx], w_t, offs, wgrad_bf16, "emulated"),
                                 grad_out, x, w_t)
    q, scale = form.quantize(x.detach(), "emulated")
    out, gx, gw = _grads(lambda: form.grouped_mm(x[idx], q[idx], scale[idx], w_t, offs, saved == "fp8", wgrad_bf16,
                                                 "emulated"), grad_out, x, w_t)
    assert torch.equal(out, ref) and torch.equal(gx, ref_gx)  # forward and dgrad: the same bits
    assert out[OFFS[-1]:].abs().max() == 0
    if saved == "bf16":
        assert torch.equal(gw, ref_gw)
        return
    # FP8 rows saved: the wgrad reads their dequantization; blockwise's FP8 wgrad would round them twice, so its rows
    # form takes the BF16 wgrad there (ops/lowp/grouped_mm_rows.py)
    x_rows = _dequantized_rows(name, q[idx], scale[idx])
    bf16_wgrad = wgrad_bf16 or name == "blockwise"
    expected = (torch.ops.moepass.grouped_mm_wgrad_bf16(grad_out, x_rows, offs) if bf16_wgrad
                else recipe.op("grouped_mm_wgrad")(grad_out, x_rows, offs, "emulated"))
    assert torch.equal(gw, expected), f"{name} rows form: wgrad is not the wgrad of the dequantized FP8 rows"


def _dequantized_rows(name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The BF16 rows a recipe's FP8 rows stand for, written out here rather than taken from the recipe."""
    if name == "fp8_rowwise":
        return (q.float() / scale).to(BF16)
    return (q.float().reshape(q.shape[0], -1, 128) * scale[..., None]).reshape(q.shape).to(BF16)


@pytest.mark.parametrize("name", ROWS_RECIPES)
def test_fp8_saved_rows_keep_the_wgrad_within_the_fp8_wgrads_error(name):
    """The issue's bar for FP8 activations: the wgrad on saved FP8 rows no worse than the FP8 wgrad on BF16 rows."""
    recipe = RECIPES[name]
    form = rows_form(recipe.op("grouped_mm"))
    for seed in range(3):
        x, w_t, idx, offs, grad_out = _problem(seed)
        ends = [0, *OFFS]
        xr, g = x.detach().float()[idx], grad_out.float()
        exact = torch.stack([xr[a:b].t() @ g[a:b] for a, b in zip(ends, ends[1:])])

        def error(w_grad):
            return ((w_grad.float() - exact).norm() / exact.norm()).item()

        fp8_wgrad = error(_grads(lambda: recipe.op("grouped_mm")(x[idx], w_t, offs, False, "emulated"),
                                 grad_out, w_t)[1])
        q, scale = form.quantize(x.detach(), "emulated")
        on_rows = error(_grads(lambda: form.grouped_mm(x[idx], q[idx], scale[idx], w_t, offs, True, False,
                                                       "emulated"), grad_out, w_t)[1])
        assert on_rows <= 1.05 * fp8_wgrad, (name, seed, on_rows, fp8_wgrad)


@pytest.mark.parametrize("name", ROWS_RECIPES)
def test_the_backward_keeps_fp8_rows_not_bf16_ones(name):
    recipe = RECIPES[name]
    form = rows_form(recipe.op("grouped_mm"))
    x, w_t, idx, offs, _ = _problem(0)
    q, scale = form.quantize(x.detach(), "emulated")
    for saved_fp8 in (True, False):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            form.grouped_mm(x[idx], q[idx], scale[idx], w_t, offs, saved_fp8, False, "emulated")
        row_tensors = {t.dtype for t in saved if t.dim() == 2 and t.shape[0] == 24}  # the gathered rows, kept as
        assert row_tensors == ({torch.float8_e4m3fn, torch.float32} if saved_fp8 else {BF16}), (saved_fp8, saved)


def test_bad_quantized_rows_are_refused_with_what_was_expected():
    recipe = RECIPES["blockwise"]
    form = rows_form(recipe.op("grouped_mm"))
    x, w_t, idx, offs, _ = _problem(0)
    q, scale = form.quantize(x.detach(), "emulated")
    with pytest.raises(ValueError, match=r"blockwise_grouped_mm_rows: x_scale must be float32 \[24, 1\]"):
        form.grouped_mm(x[idx], q[idx], scale[idx][:20], w_t, offs, True, False, "emulated")
    with pytest.raises(ValueError, match=r"x_q must be torch.float8_e4m3fn \[24, 128\]"):
        form.grouped_mm(x[idx], q[idx].float(), scale[idx], w_t, offs, True, False, "emulated")
    with pytest.raises(ValueError, match="kernel 'deepgemm' has no rows form"):
        form.quantize(x.detach(), "deepgemm")
    q, scale = rows_form(RECIPES["fp8_rowwise"].op("grouped_mm")).quantize(x.detach(), "emulated")
    grad_out = torch.randn(24, N).to(BF16)
    with pytest.raises(ValueError, match=r"fp8_rowwise_grouped_mm_wgrad_on_rows: x_scale must be float32 \[24, 1\]"):
        torch.ops.moepass.fp8_rowwise_grouped_mm_wgrad_on_rows(grad_out, q[idx], scale[idx][:20], offs, "emulated")
    with pytest.raises(ValueError, match=r"fp8_rowwise_token_group_cols: t must be torch.float8_e4m3fn with row_scale"):
        torch.ops.moepass.fp8_rowwise_token_group_cols(x.detach(), offs, scale)


class Experts(torch.nn.Module):
    """Routed SwiGLU experts fed by a gather of token rows, spelled as `how` says."""

    def __init__(self, how: str):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w1, self.w3 = (torch.nn.Parameter((torch.randn(3, 128, K, generator=g) / 12).to(BF16)) for _ in "13")
        self.w2 = torch.nn.Parameter((torch.randn(3, K, 128, generator=g) / 12).to(BF16))
        self.how = how

    def forward(self, x, idx, offs):
        if self.how == "getitem":
            rows = x[idx]
        elif self.how == "index_select":
            rows = x.index_select(0, idx)
        else:  # two gathers: a padded copy (a zero row appended), then a permutation of it
            rows = torch.cat([x, x.new_zeros(1, x.shape[1])])[idx.flip(0)][torch.arange(idx.shape[0] - 1, -1, -1)]
        h = F.silu(torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(rows, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


@pytest.mark.parametrize("how", ["getitem", "index_select", "two_gathers"])
def test_pass_quantizes_the_token_rows_once_for_w1_and_w3(how):
    x, _, idx, offs, _ = _problem(2)
    base = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "fp8_rowwise.wgrad_bf16": False,
            "inductor": False}
    results = {}
    for passes in (["grouped_mm"], ["grouped_mm", "quantize_once"]):
        torch._dynamo.reset()
        model = Experts(how)
        with moepass.collecting() as report:
            out = torch.compile(model, backend="moepass", options={**base, "passes": passes})(x, idx, offs)
            out.float().square().sum().backward()
        results[len(passes)] = out.detach(), x.grad.clone(), [p.grad for p in model.parameters()], report.to_dict()
        x.grad = None
    (ref, ref_gx, ref_gw, _), (out, gx, gw, report) = results[1], results[2]
    assert torch.equal(out, ref) and torch.equal(gx, ref_gx)
    # fp8_rowwise's FP8 wgrad re-quantizes the exactly dequantized rows along tokens with power-of-two scales: the
    # same e4m3 values but where a value falls below e4m3's normal range (rounded twice, not once)
    for a, b in zip(gw, ref_gw):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-4
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["quantize_once"]["replaced"] == 3 and passes["quantize_once"]["skipped"] == []
    # one quantization of the token rows for w1 and w3 (w2's input, no gather, is quantized where it is)
    assert report["ops_after"]["moepass.fp8_rowwise_quantize_rows"] == 2
    assert report["ops_after"]["moepass.fp8_rowwise_grouped_mm_rows"] == 3


@pytest.mark.parametrize("recipe, wgrad_bf16, saved", [
    ("fp8_rowwise", False, "FP8"),  # its FP8 wgrad re-quantizes the saved FP8 rows exactly
    ("blockwise", True, "FP8"),  # a BF16 wgrad reads dequantized rows at its own precision
    ("blockwise", False, "BF16"),  # FP8 rows would turn its FP8 wgrad into a BF16 one: BF16 rows kept
])
def test_saved_rows_auto_keeps_fp8_rows_where_the_wgrad_keeps_its_precision(recipe, wgrad_bf16, saved):
    x, _, idx, offs, _ = _problem(4)
    torch._dynamo.reset()
    options = {"recipe": recipe, f"{recipe}.kernel": "emulated", f"{recipe}.wgrad_bf16": wgrad_bf16,
               "inductor": False, "passes": ["grouped_mm", "quantize_once"]}
    with moepass.collecting() as report:
        out = torch.compile(Experts("getitem"), backend="moepass", options=options)(x, idx, offs)
        out.float().square().sum().backward()
    rewrites = {p["name"]: p for p in report.to_dict()["passes"]}["quantize_once"]["rewrites"]
    assert len(rewrites) == 3 and all(f"{saved} rows saved for the wgrad" in r["detail"] for r in rewrites), rewrites


class MoE(torch.nn.Module):
    """The experts as a submodule: their three GEMMs share its module path."""

    def __init__(self):
        super().__init__()
        self.experts = Experts("getitem")

    def forward(self, x, idx, offs):
        return self.experts(x, idx, offs)


def test_pass_leaves_a_recipe_without_rows_form_alone_with_the_reason():
    x, _, idx, offs, _ = _problem(3)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        torch.compile(MoE(), backend="moepass",
                      options={"recipe": "mxfp8", "inductor": False, "passes": ["grouped_mm", "quantize_once"]})(
            x, idx, offs)
    skipped = {p["name"]: p for p in report.to_dict()["passes"]}["quantize_once"]["skipped"]
    assert len(skipped) == 3 and all("no rows form" in s["reason"] for s in skipped), skipped
    assert {s["module"] for s in skipped} == {"experts"}
    # the summary names the module once for its three GEMMs (w1, w3, w2)
    assert "[quantize_once] experts (x3): " in report.summary(), report.summary()


def test_an_unexpected_error_leaves_the_gemm_as_grouped_mm_left_it(monkeypatch):
    """A moepass bug never fails the user's compile: the pass reports it and the graph runs unchanged."""
    from moepass.passes import quantize_once

    def broken(*args):
        raise RuntimeError("injected")

    x, _, idx, offs, _ = _problem(6)
    options = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "inductor": False}
    torch._dynamo.reset()
    want = torch.compile(Experts("getitem"), backend="moepass", options={**options, "passes": ["grouped_mm"]})(
        x, idx, offs)
    monkeypatch.setattr(quantize_once, "_quantized_rows", broken)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        got = torch.compile(Experts("getitem"), backend="moepass",
                            options={**options, "passes": ["grouped_mm", "quantize_once"]})(x, idx, offs)
    d = report.to_dict()
    skipped = {p["name"]: p for p in d["passes"]}["quantize_once"]["skipped"]
    assert len(skipped) == 3 and all("could not rewrite: RuntimeError('injected')" in s["reason"] for s in skipped)
    assert "moepass.fp8_rowwise_quantize_rows" not in d["ops_after"]
    assert d["ops_after"]["moepass.fp8_rowwise_grouped_mm"] == 3
    assert torch.equal(got, want)


def test_inductor_drops_the_bf16_rows_the_rows_form_does_not_read():
    """Through the backend's decompositions the forward runs the GEMM on (q, scale) alone
    (moepass::<recipe>_grouped_mm_on_rows), so no BF16 gathered rows are computed for it, with grouped_mm's numbers."""
    from torch._inductor.utils import run_and_get_code

    x, _, idx, offs, _ = _problem(4)
    options = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated"}
    outs = []
    for passes in (["grouped_mm"], ["grouped_mm", "quantize_once"]):  # Inductor's SiLU * up is not eager's: A/B both
        torch._dynamo.reset()
        compiled = torch.compile(Experts("getitem"), backend="moepass", options={**options, "passes": passes})
        out, code = run_and_get_code(compiled, x, idx, offs)
        outs.append(out)
    forward = "\n".join(code)
    calls = "torch.ops.moepass.fp8_rowwise_grouped_mm_{}.default("
    assert forward.count(calls.format("on_rows")) == 3 and calls.format("rows") not in forward
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------- under expert parallelism (gloo, 2 ranks)


def _ep_step(model, tokens, options):
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        out = torch.compile(model, backend="moepass", options=options)(tokens)
        out.float().square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, report.to_dict()


def check_fp8_rows_are_dispatched(rank, world_size):
    import torch.distributed as dist

    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=2, ep_group=dist.group.WORLD)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(rank))
    base = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "fp8_rowwise.wgrad_bf16": False,
            "deepep.backend": "reference", "inductor": False}
    ref_out, ref_grads, _ = _ep_step(model, tokens, {**base, "passes": ["deepep", "grouped_mm"]})
    out, grads, report = _ep_step(model, tokens, {**base, "passes": ["deepep", "grouped_mm", "quantize_once"]})
    passes = {p["name"]: p for p in report["passes"]}
    assert passes["deepep"]["replaced"] == 1
    quantize_once = passes["quantize_once"]
    assert [r["op"] for r in quantize_once["rewrites"]].count("moepass.ep_dispatch_quantized") == 1, quantize_once
    assert quantize_once["skipped"] == []
    ops = report["ops_after"]
    assert ops["moepass.ep_dispatch_quantized"] == 1 and "moepass.ep_dispatch" not in ops
    # the token rows are quantized once, before the dispatch; w2's input where it is
    assert ops["moepass.fp8_rowwise_quantize_rows"] == 2
    # forward and input gradients: the bits of quantizing the received rows (per-row scales commute with the
    # exchange); the experts' FP8 wgrads read the dequantized rows (the same e4m3 values but below the normal range)
    assert torch.equal(out, ref_out)
    for name, grad in grads.items():
        ref = ref_grads[name]
        if ".experts." in name:
            assert ((grad.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3, name
        else:
            assert torch.equal(grad, ref), name


def check_bf16_saved_rows_keep_the_bf16_dispatch(rank, world_size):
    import torch.distributed as dist

    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=2, ep_group=dist.group.WORLD)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(rank))
    options = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "deepep.backend": "reference",
               "inductor": False, "passes": ["deepep", "grouped_mm", "quantize_once"],
               "quantize_once.saved_rows": "bf16"}
    _, _, report = _ep_step(model, tokens, options)
    skipped = {p["name"]: p for p in report["passes"]}["quantize_once"]["skipped"]
    assert len(skipped) == 1 and "dispatch sends BF16" in skipped[0]["reason"], skipped
    assert "keeps BF16 rows for its wgrad (quantize_once.saved_rows 'bf16'" in skipped[0]["reason"]
    assert report["ops_after"]["moepass.ep_dispatch"] == 1


def test_fp8_rows_cross_the_ep_dispatch(rank_pool):
    rank_pool(2).run(check_fp8_rows_are_dispatched, timeout_s=300)


def test_bf16_saved_rows_keep_the_bf16_dispatch_with_the_reason(rank_pool):
    rank_pool(2).run(check_bf16_saved_rows_keep_the_bf16_dispatch, timeout_s=300)


def check_fp8_dispatch_through_inductor(rank, world_size):
    import torch.distributed as dist

    from moepass.models import build_model

    torch.manual_seed(0)
    model = build_model("debug", n_layers=2, ep_group=dist.group.WORLD)
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(rank))
    base = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "fp8_rowwise.wgrad_bf16": False,
            "deepep.backend": "reference"}
    ref_out, ref_grads, _ = _ep_step(model, tokens, {**base, "passes": ["deepep", "grouped_mm"]})
    out, grads, report = _ep_step(model, tokens, {**base, "passes": ["deepep", "grouped_mm", "quantize_once"]})
    assert report["ops_after"]["moepass.ep_dispatch_quantized"] == 1
    forward = [c["ops"] for c in report["compiled_graphs"] if c["kind"] == "forward"]
    assert forward and all("moepass.ep_dispatch" not in ops for ops in forward), forward
    assert torch.equal(out, ref_out)
    for name, grad in grads.items():
        ref = ref_grads[name]
        assert ((grad.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3, name


@pytest.mark.extended  # ~2 min on 2 cores; CI runs the same rewrite without Inductor above
def test_fp8_dispatch_compiles_with_inductor(rank_pool):
    rank_pool(2).run(check_fp8_dispatch_through_inductor, timeout_s=580)


# ---------------------------------------------------------------- on an sm_90 GPU (skipped elsewhere)

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="the FP8 rowwise and blockwise grouped kernels run on sm_90")
@pytest.mark.parametrize("name", ROWS_RECIPES)
def test_rows_form_on_gpu_is_bit_equal_eager_and_through_the_backend(name):
    """Kernel "scaled_mm": the rows form's forward and dgrad equal the grouped op's, and its wgrad on the saved FP8
    rows equals the wgrad on their dequantization (fp8_rowwise's reads the FP8 rows itself), eagerly; and compiled by
    the backend (Inductor fusing the quantization, the GEMM reading quantized rows)."""
    recipe = RECIPES[name]
    form = rows_form(recipe.op("grouped_mm"))
    x, w_t, idx, offs, grad_out = (t.cuda() if t.dtype != BF16 else t.detach().cuda().requires_grad_(t.requires_grad)
                                   for t in _problem(5))
    ref, ref_gx = _grads(lambda: recipe.op("grouped_mm")(x[idx], w_t, offs, False, "scaled_mm"), grad_out, x)
    q, scale = form.quantize(x.detach(), "scaled_mm")
    out, gx, gw = _grads(lambda: form.grouped_mm(x[idx], q[idx], scale[idx], w_t, offs, True, False, "scaled_mm"),
                         grad_out, x, w_t)
    assert torch.equal(out, ref) and torch.equal(gx, ref_gx)
    x_rows = _dequantized_rows(name, q[idx], scale[idx])
    want_gw = (recipe.op("grouped_mm_wgrad")(grad_out, x_rows, offs, "scaled_mm") if form.fp8_wgrad_on_rows
               else torch.ops.moepass.grouped_mm_wgrad_bf16(grad_out, x_rows, offs))
    assert torch.equal(gw, want_gw), f"{name}: the wgrad on saved FP8 rows is not the wgrad on their dequantization"
    outs = []
    for passes in (["grouped_mm"], ["grouped_mm", "quantize_once"]):
        torch._dynamo.reset()
        model = Experts("getitem").cuda()
        options = {"recipe": name, f"{name}.kernel": "scaled_mm", "passes": passes}
        outs.append(torch.compile(model, backend="moepass", options=options)(x.detach(), idx, offs))
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------- models this project did not write


def _torchtitan_debugmodel():
    pytest.importorskip("torchtitan")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12):
        pytest.skip("torchtitan 0.3.0 needs torch >= 2.12")
    from realstack.titan_configs import sdpa_debugmodel

    model = sdpa_debugmodel(n_layers=2)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(tokens), 3


def _hf_deepseek_v3():
    pytest.importorskip("transformers")
    from test_hf_families import build

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    return build("DeepseekV3"), lambda m: m(ids).logits, 2


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning")
@pytest.mark.parametrize("make", [_torchtitan_debugmodel, _hf_deepseek_v3], ids=["torchtitan", "transformers"])
def test_unmodified_models_get_their_token_rows_quantized_before_the_gather(make):
    """torchtitan's DeepSeek-V3 (`x_TD[idx]`, then `.bfloat16()`) and transformers' (`hidden_states[idx]`, then
    `.to(torch.bfloat16)`): the gather is found through the no-op casts; with BF16 rows kept for the wgrad, every
    number is grouped_mm's, bit for bit."""
    import copy

    model, call, gemms = make()
    base = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "inductor": False,
            "quantize_once.saved_rows": "bf16"}
    runs = []
    for passes in (["grouped_mm"], ["grouped_mm", "quantize_once"]):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        with moepass.collecting() as report:
            out = call(torch.compile(m, backend="moepass", options={**base, "passes": passes}))
            out.float().square().mean().backward()
        runs.append((out.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None},
                     report.to_dict()))
    (ref, ref_grads, _), (out, grads, report) = runs
    rewrites = {p["name"]: p for p in report["passes"]}["quantize_once"]["rewrites"]
    assert len(rewrites) == gemms, rewrites
    assert sum("quantized before 1 gather(s)" in r["detail"] for r in rewrites) == gemms - 1, rewrites  # not w2
    assert report["ops_after"]["moepass.fp8_rowwise_quantize_rows"] == 2  # the token rows once; w2's input
    assert torch.equal(out, ref) and grads.keys() == ref_grads.keys()
    assert [n for n in grads if not torch.equal(grads[n], ref_grads[n])] == []


class CheckpointedExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Experts("getitem")

    def forward(self, x, idx, offs):
        return torch.utils.checkpoint.checkpoint(self.inner, x, idx, offs, use_reentrant=False)


def test_an_activation_checkpointed_block_is_rewritten_inside_its_body():
    x, _, idx, offs, _ = _problem(7)
    base = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "emulated", "fp8_rowwise.wgrad_bf16": False,
            "inductor": False}
    runs = []
    for passes in (["grouped_mm"], ["grouped_mm", "quantize_once"]):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = CheckpointedExperts()
        x.grad = None
        with moepass.collecting() as report:
            out = torch.compile(model, backend="moepass", options={**base, "passes": passes})(x, idx, offs)
            out.float().square().sum().backward()
        runs.append((out.detach(), x.grad.clone(), report.to_dict()))
    (ref, ref_gx, _), (out, gx, report) = runs
    rewrites = {p["name"]: p for p in report["passes"]}["quantize_once"]["rewrites"]
    assert len(rewrites) == 3 and all(r["node"].startswith("wrap_body") for r in rewrites), rewrites
    assert torch.equal(out, ref) and torch.equal(gx, ref_gx)
