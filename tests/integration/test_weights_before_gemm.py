"""weights_before_gemm: a per-row (routing) weight of a GEMM's output moves onto its input.

The spellings are those of real MoE code: ours (`grouped_mm(...).float() * w.unsqueeze(-1)`), torchtitan's
(`(out.type_as(x).to(float32) * s.reshape(-1, 1)).to(bf16)`), transformers' per-expert loop
(`linear(h, W[e]) * w[idx, pos, None]`) and a plain `h @ W.t()`. Numerics are checked against a float32 run of the
same module: the moved product may not be further from it than the model's own BF16 product is (times a margin).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import moepass
from moepass.skips import SkipCode
from helpers import load_example, scaled_grouped_mm_on_cpu, scaled_mm_on_cpu  # noqa: F401  (fixtures)

BF16 = torch.bfloat16
ONLY = {"passes": ["weights_before_gemm"], "inductor": False}
ENDS = (0, 10, 25, 40)  # expert group ends of the 40 rows


class Experts(torch.nn.Module):
    """SwiGLU experts over expert-sorted rows; `spelling` is how the routing weight meets the down projection."""

    def __init__(self, spelling: str, e: int = 3, d: int = 32, f: int = 16):
        super().__init__()
        self.spelling = spelling
        self.w13 = torch.nn.Parameter(torch.randn(e, d, 2 * f) / d ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(e, f, d) / f ** 0.5)
        self.b2 = torch.nn.Parameter(torch.randn(d) / 10)

    def forward(self, x, w, offs):
        gate, up = torch._grouped_mm(x, self.w13, offs=offs).chunk(2, dim=-1)
        h = F.silu(gate) * up
        if self.spelling == "ours":
            return torch._grouped_mm(h, self.w2, offs=offs).float() * w.unsqueeze(-1)
        if self.spelling == "torchtitan":
            out = torch._grouped_mm(h, self.w2, offs=offs).type_as(x)
            return (out.to(torch.float32) * w.reshape(-1, 1)).to(out.dtype)
        if self.spelling == "transformers":  # one linear per expert, weight column by indexing
            outs = []
            for e, (start, end) in enumerate(zip(ENDS[:-1], ENDS[1:])):
                rows = torch.arange(start, end)
                outs.append(F.linear(h[start:end], self.w2[e].t()) * w[rows, None])
            return torch.cat(outs)
        if self.spelling == "matmul":
            return (h @ self.w2[0]) * w[:, None]
        # ---- left alone
        if self.spelling == "bias":
            return F.linear(h, self.w2[0].t(), self.b2) * w[:, None]
        if self.spelling == "output_read_too":
            out = torch._grouped_mm(h, self.w2, offs=offs)
            return out * w[:, None] + out.square().mean()
        if self.spelling == "weight_from_output":  # a norm, not a routing weight
            out = torch._grouped_mm(h, self.w2, offs=offs)
            return out * torch.rsqrt(out.float().square().mean(-1, keepdim=True)).to(out.dtype)
        if self.spelling == "per_column":
            return torch._grouped_mm(h, self.w2, offs=offs) * self.b2.to(h.dtype)[None, :]
        raise ValueError(self.spelling)


def _inputs(rows: int = ENDS[-1], d: int = 32, dtype=BF16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, d, generator=g).to(dtype)
    w = torch.rand(rows, generator=g)  # fp32 routing weights, as routers return them
    return x, w, torch.tensor(ENDS[1:], dtype=torch.int32)


def _run(model, options, x, w, offs):
    """Output and the grads of x, w and every parameter, of one forward and backward."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn = model if options is None else torch.compile(model, backend="moepass", options=options)
    out = fn(x, w, offs)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {"x": x.grad, "w": w.grad, **{n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
    return out.detach(), grads


def _err(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("spelling", ["ours", "torchtitan", "transformers", "matmul"])
def test_the_weight_moves_onto_the_input_within_the_models_own_rounding(spelling):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Experts(spelling).to(BF16)
    x, w, offs = _inputs()
    ref_out, ref_grads = _run(copy.deepcopy(model).float(), None, x.float(), w, offs)
    eager_out, eager_grads = _run(copy.deepcopy(model), None, x, w, offs)
    with moepass.collecting() as report:
        out, grads = _run(model, ONLY, x, w, offs)
    rewrites = {p["name"]: p for p in report.to_dict()["passes"]}["weights_before_gemm"]["rewrites"]
    assert len(rewrites) == (3 if spelling == "transformers" else 1), rewrites
    assert all(r["op"] == "weight before the GEMM" and "16] input" in r["detail"] for r in rewrites), rewrites
    assert out.dtype == eager_out.dtype and out.shape == eager_out.shape
    assert _err(out, ref_out) <= 2 * _err(eager_out, ref_out) + 1e-3
    assert grads.keys() == eager_grads.keys()
    for name in grads:  # the weights' gradient is now a row sum over F, not D: the same quantity
        assert _err(grads[name], ref_grads[name]) <= 2 * _err(eager_grads[name], ref_grads[name]) + 1e-3, name


@pytest.mark.parametrize("spelling, code", [("bias", SkipCode.WEIGHT_WITH_BIAS),
                                            ("output_read_too", SkipCode.OUTPUT_READ_ELSEWHERE)])
def test_a_weight_that_cannot_move_is_left_alone_with_the_reason(spelling, code):
    torch._dynamo.reset()
    model = Experts(spelling).to(BF16)
    x, w, offs = _inputs()
    eager_out, _ = _run(copy.deepcopy(model), None, x, w, offs)
    with moepass.collecting() as report:
        out, _ = _run(model, ONLY, x, w, offs)
    record = next(p for p in report.pass_totals() if p.name == "weights_before_gemm")
    assert record.rewrites == [] and len(record.skipped) == 1, record
    assert record.skipped[0].code is code and code.phrase in record.skipped[0].reason, record
    assert torch.equal(out, eager_out)  # untouched: the same graph eager ran


@pytest.mark.parametrize("spelling", ["weight_from_output", "per_column"])
def test_a_product_that_is_no_row_weight_is_not_touched_or_reported(spelling):
    torch._dynamo.reset()
    model = Experts(spelling).to(BF16)
    x, w, offs = _inputs()
    with moepass.collecting() as report:
        _run(model, ONLY, x, w, offs)
    record = {p["name"]: p for p in report.to_dict()["passes"]}["weights_before_gemm"]
    assert record["rewrites"] == [] and record["skipped"] == [], record


@pytest.fixture(params=["emulated", "scaled_mm"])
def kernel(request):
    """emulated: FP8 rowwise as it runs on CPU; scaled_mm: decomposed as on the GPU (torch._scaled_mm and
    torch._scaled_grouped_mm by CPU stand-ins)."""
    if request.param == "scaled_mm":
        request.getfixturevalue("scaled_grouped_mm_on_cpu")
    return request.param


def test_the_backward_keeps_no_unweighted_expert_output_also_under_a_users_saved_tensor_hooks(kernel):
    """One MoE layer of our DeepSeek-V3 through the whole default pipeline (Inductor on): the forward keeps exactly
    the experts' [N, D] BF16 output less, and saves nothing new. The counting hook reads data pointers, which fake
    tensors refuse: the pass's shape propagation must not run a user's hooks."""
    from moepass.harness.model_spec import ModelSpec

    spec = ModelSpec("debug", {"n_layers": 1, "n_dense_layers": 0, "dim": 128, "moe_inter_dim": 64,
                               "vocab_size": 512, "n_heads": 2, "kv_lora_rank": 64})
    tokens = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    saved, reports = {}, {}
    everything = list(moepass.options.DEFAULT_PASSES)
    for name, passes in (("with", everything), ("without", [p for p in everything if p != "weights_before_gemm"])):
        torch._dynamo.reset()
        with moepass.collecting() as report:
            compiled = torch.compile(spec.build(0, torch.device("cpu")), backend="moepass",
                                     options={"passes": passes, "recipe": "fp8_rowwise",
                                              "fp8_rowwise.kernel": kernel})
            saved[name] = load_example("saved_activations").saved_bytes(compiled, tokens)["by_dtype"]
        reports[name] = {p["name"]: p for p in report.to_dict()["passes"]}
    assert len(reports["with"]["weights_before_gemm"]["rewrites"]) == 1, reports["with"]["weights_before_gemm"]
    experts = spec.build(0, torch.device("cpu")).layers[0].moe
    rows = 64 * experts.top_k
    less = {dtype: saved["without"][dtype] - saved["with"].get(dtype, 0) for dtype in saved["without"]}
    assert less == {**{dtype: 0 for dtype in less}, "bfloat16": rows * 128 * 2}, saved  # [N, D] BF16, nothing else


# ---------------------------------------------------------------- models this project did not write


def _torchtitan(n_layers: int = 3):
    pytest.importorskip("torchtitan")
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12):
        pytest.skip("torchtitan 0.3.0 needs torch >= 2.12")
    from realstack.titan_configs import sdpa_debugmodel

    model = sdpa_debugmodel(n_layers=n_layers)
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(1))
    return model, lambda m: m(tokens), [f"layers.{i}.moe.routed_experts.inner_experts" for i in (1, 2)]


def _transformers():
    pytest.importorskip("transformers")
    from test_hf_families import build

    model = build("DeepseekV3")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    moe = [n for n, m in model.named_modules() if type(m).__name__ == "DeepseekV3Experts"]
    return model, lambda m: m(ids).logits, moe


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning")
@pytest.mark.parametrize("make", [_torchtitan, _transformers], ids=["torchtitan", "transformers"])
def test_unmodified_models_get_their_routing_weights_moved(make):
    """torchtitan's `(out.to(float32) * scores.reshape(-1, 1)).to(bf16)` in its token dispatcher's combine, and
    transformers' grouped_mm experts' `proj_out * sample_weights_g.unsqueeze(-1)`: one rewrite per MoE layer, the
    loss and every gradient as near eager as BF16 rounding allows."""
    model, call, experts = make()
    assert experts, "no MoE layer found in the model"
    runs = []
    for options in (None, ONLY):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        with moepass.collecting() as report:
            out = call(m if options is None else torch.compile(m, backend="moepass", options=options))
            out.float().square().mean().backward()
        runs.append((out.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None},
                     report))
    (ref, ref_grads, _), (out, grads, report) = runs
    record = next(p for p in report.pass_totals() if p.name == "weights_before_gemm")
    assert sorted(r.module for r in record.rewrites) == sorted(experts) and record.skipped == [], record
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert ((grad - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12)).item() < 5e-2, name
