"""GEMMs a user converted with torchao stay torchao's: untouched, listed with the config, numerics Inductor's.

The model is the project's MoE layer (moepass.models.MoE) as a user converts it with torchao 0.18 on CPU: the routed
experts through MoE training's `quantize_(MXFP8TrainingOpConfig(kernel_preference=EMULATED))`, and the shared
expert's three linears each one way torchao converts a linear: `convert_to_float8_training` (Float8Linear, emulated),
torchtitan's MXFP8 converter (MXFP8Linear, emulated), and `quantize_` of the linear (a tensor-subclass weight). The
router gate stays plain; moepass keeps it BF16 as Inductor runs it, so moepass has nothing of its own to rewrite.
"""

import functools

import pytest
import torch
from helpers import compile_caches_off
from torch import fx

import moepass
from moepass.analysis.torchao_converted import find_torchao_gemm_calls, torchao_conversion
from moepass.analysis.graph import is_gemm
from moepass.analysis.node_module import module_path
from moepass.report.left_alone import explain
from moepass.skips import SkipCode

pytest.importorskip("torchao.prototype.moe_training")

BF16 = torch.bfloat16
LEFT = "converted by torchao ({}): left to it"


def _torchao():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quant_api import quantize_
    from torchao.quantization.quantize_.common import KernelPreference

    return (Float8LinearConfig, convert_to_float8_training, MXFP8TrainingOpConfig, MXFP8Linear, ScaleCalculationMode,
            quantize_, KernelPreference)


def converted_moe(wgrad_with_hp: bool = False, convert: str = "all") -> torch.nn.Module:
    """The debug MoE layer at small sizes (every K and N a multiple of 32), seeded, converted as the docstring says
    ("all"), only its experts ("experts"), or not at all ("none")."""
    from moepass.models import MoE, get_config

    torch.manual_seed(0)
    moe = MoE(get_config("debug", dim=128, moe_inter_dim=64))
    moe.init_weights(0.02, 0.02)
    if convert == "none":
        return moe
    f8_config, to_float8, mx_config, mx_linear, scale_mode, quantize_, kernel = _torchao()
    emulated = mx_config(kernel_preference=kernel.EMULATED, wgrad_with_hp=wgrad_with_hp)
    quantize_(moe, emulated, filter_fn=lambda module, fqn: fqn == "experts")
    if convert == "experts":
        return moe
    to_float8(moe, config=f8_config(emulate=True), module_filter_fn=lambda module, fqn: fqn == "shared_experts.w1")
    w3 = moe.shared_experts.w3  # as torchtitan's MXFP8LinearConverter swaps the class in place
    w3.__class__ = mx_linear
    w3.kernel_preference, w3.scale_calculation_mode, w3.wgrad_with_hp = kernel.EMULATED, scale_mode.RCEIL, False
    quantize_(moe, emulated, filter_fn=lambda module, fqn: fqn == "shared_experts.w2")
    return moe


def _tokens() -> torch.Tensor:
    return torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(1)).to(BF16)


# ---------------------------------------------------------------- the detector, on the graph moepass receives


def _graph(model, *args) -> fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*args)
    (gm,) = graphs
    return gm


def test_each_conversion_is_named_by_its_config():
    gm = _graph(converted_moe(), _tokens())
    named = {(module_path(n), n.name): torchao_conversion(n) for n in gm.graph.nodes
             if is_gemm(n) or torchao_conversion(n)}
    by_module = {}
    for (module, _), conversion in named.items():
        by_module.setdefault(module, []).append(conversion)
    assert by_module == {"router.gate": [None], "experts": ["MXFP8TrainingOpConfig"] * 3,
                         "shared_experts.w1": ["Float8LinearConfig"], "shared_experts.w3": ["MXFP8Linear"],
                         "shared_experts.w2": ["MXFP8TrainingOpConfig"]}
    calls = {(c.module, c.kind, c.conversion) for c in find_torchao_gemm_calls(gm)}
    assert calls == {("shared_experts.w1", "linear", "Float8LinearConfig"),
                     ("shared_experts.w3", "linear", "MXFP8Linear")}  # the opaque ones: no GEMM node to match


def test_a_weight_tensor_is_named_by_its_config_and_a_plain_one_is_not():
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    w = torch.randn(2, 32, 64, dtype=BF16)
    wrapped = Float8TrainingWeightWrapperTensor(w, Float8TrainingOpConfig())
    assert torchao_conversion(wrapped) == "Float8TrainingOpConfig"
    assert torchao_conversion(w) is None


def test_a_spelling_the_weight_wrapper_does_not_take_stays_moepass_business():
    """torchao's MoE-training wrapper converts F.linear (and matmul, mm, addmm), not einsum or bmm: those run BF16 on
    the unwrapped weight, so moepass treats them as any GEMM."""
    _, _, mx_config, _, _, quantize_, kernel = _torchao()

    class Spellings(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 32, bias=False, dtype=BF16)

        def forward(self, x):
            w = self.proj.weight
            return torch.nn.functional.linear(x, w) + torch.einsum("tk,nk->tn", x, w)

    model = Spellings()
    quantize_(model, mx_config(kernel_preference=kernel.EMULATED))
    gm = _graph(model, torch.randn(32, 64, dtype=BF16))
    found = [(getattr(n.target, "__name__", n.target), torchao_conversion(n)) for n in gm.graph.nodes if is_gemm(n)]
    assert found == [("linear", "MXFP8TrainingOpConfig"), ("einsum", None)]


def test_a_direct_call_of_torchaos_grouped_gemm_is_found():
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common import KernelPreference

    def experts(x, w, offs):
        return _to_mxfp8_then_scaled_grouped_mm(x, w.transpose(-2, -1), offs=offs,
                                                kernel_preference=KernelPreference.EMULATED)

    gm = _graph(experts, torch.randn(64, 64, dtype=BF16), torch.randn(2, 32, 64, dtype=BF16),
                torch.tensor([32, 64], dtype=torch.int32))
    ((call,),) = [find_torchao_gemm_calls(gm)]
    assert (call.kind, call.conversion) == ("grouped", "_to_mxfp8_then_scaled_grouped_mm")


# ---------------------------------------------------------------- compiled with moepass and with Inductor


@functools.cache
def _step(backend: str, wgrad_with_hp: bool, options: tuple = (), convert: str = "all"):
    """Loss, input gradient and parameter gradients of one step, and moepass's report; caches off."""
    torch._dynamo.reset()
    model, x = converted_moe(wgrad_with_hp, convert), _tokens().requires_grad_()
    kwargs = {"options": dict(options)} if backend == "moepass" else {}
    with moepass.collecting() as report, compile_caches_off():
        loss = torch.compile(model, backend=backend, **kwargs)(x).float().square().mean()
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), x.grad, grads, report


def test_converted_gemms_are_left_to_torchao_and_listed():
    *_, report = _step("moepass", False)
    d = report.to_dict()
    assert d["ops_after"] == d["ops_before"]  # nothing rewritten
    assert d["ops_after"]["_grouped_mm"] == 3 and d["ops_after"]["trampoline_autograd_apply"] == 2
    compiled = [op for c in report.compiled for op in c["ops"]]
    assert compiled and not [op for op in compiled if op.startswith("moepass.")]
    passes = {p["name"]: p for p in d["passes"]}
    assert all(p["replaced"] == 0 for p in passes.values()), passes
    listed = sorted((p, s["module"], s["reason"]) for p in ("grouped_mm", "linear") for s in passes[p]["skipped"]
                    if "torchao" in s["reason"])
    assert listed == [("grouped_mm", "experts", LEFT.format("MXFP8TrainingOpConfig"))] * 3 + [
        ("linear", "shared_experts.w1", LEFT.format("Float8LinearConfig")),
        ("linear", "shared_experts.w2", LEFT.format("MXFP8TrainingOpConfig")),
        ("linear", "shared_experts.w3", LEFT.format("MXFP8Linear"))]
    # the routing weight stays on the experts' output, where torchao's GEMM expects it
    (moved,) = passes["weights_before_gemm"]["skipped"]
    assert moved["reason"] == LEFT.format("MXFP8TrainingOpConfig")
    codes = {explain(s) for g in report.graphs for p in g.passes for s in p.skipped if "torchao" in s.reason}
    assert codes == {SkipCode.TORCHAO_CONVERTED}
    assert all(SkipCode.TORCHAO_CONVERTED.phrase in s.reason for g in report.graphs for p in g.passes
               for s in p.skipped if "torchao" in s.reason)


def test_numerics_are_inductors_on_the_same_converted_model():
    """Bit-equal: moepass hands Inductor the graph Dynamo gave it, so the same code computes the same values."""
    loss, x_grad, grads, _ = _step("moepass", False)
    ref_loss, ref_x_grad, ref_grads, _ = _step("inductor", False)
    assert torch.equal(loss, ref_loss) and torch.equal(x_grad, ref_x_grad)
    assert [n for n in grads if not torch.equal(grads[n], ref_grads[n])] == []


@pytest.mark.extended
def test_torchaos_wgrad_with_hp_reaches_the_gradients_as_under_inductor():
    """The user's torchao option is honoured: it changes w2's gradient under moepass, exactly as under Inductor."""
    low, high = _step("moepass", False)[2], _step("moepass", True)[2]
    ref_high = _step("inductor", True)[2]
    assert not torch.equal(low["experts.w2"], high["experts.w2"])
    assert [n for n in high if not torch.equal(high[n], ref_high[n])] == []


def test_take_over_rewrites_subclass_weights_as_if_unconverted():
    """lowp.take_over_torchao: the experts and the quantize_-converted linear become moepass's, named as overriding
    torchao; the opaque Float8Linear / MXFP8Linear calls stay torchao's, and say the option cannot reach them."""
    # the passes' rewrites and reasons, which Inductor does not change: the rewritten graph runs eagerly (no compile)
    options = (("lowp.take_over_torchao", True), ("inductor", False))
    *_, report = _step("moepass", False, options)
    passes = {p["name"]: p for p in report.to_dict()["passes"]}
    rewrites = [(r["module"], r["op"]) for p in ("grouped_mm", "linear") for r in passes[p]["rewrites"]]
    assert sorted(rewrites) == [("experts", "moepass.mxfp8_grouped_mm")] * 3 + [
        ("shared_experts.w2", "moepass.mxfp8_linear")]
    assert all("overrode torchao's MXFP8TrainingOpConfig" in r["detail"]
               for p in ("grouped_mm", "linear") for r in passes[p]["rewrites"])
    kept = sorted((s["module"], s["reason"]) for s in passes["linear"]["skipped"] if "torchao" in s["reason"])
    assert [m for m, _ in kept] == ["shared_experts.w1", "shared_experts.w3"]
    assert all("lowp.take_over_torchao reaches tensor-subclass weights only" in r for _, r in kept)


@pytest.mark.extended
def test_taken_over_experts_compute_as_unconverted_ones():
    """Bit-equal: with lowp.take_over_torchao the torchao weight is only a carrier; moepass's recipe decides."""
    options = (("lowp.take_over_torchao", True),)
    taken, plain = _step("moepass", False, options, "experts"), _step("moepass", False, options, "none")
    assert torch.equal(taken[0], plain[0]) and torch.equal(taken[1], plain[1])
    assert [n for n in taken[2] if not torch.equal(taken[2][n], plain[2][n])] == []
