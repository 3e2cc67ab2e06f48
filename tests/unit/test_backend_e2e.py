"""The debug DeepSeek-V3 under torch.compile(backend="moepass"): rewrite, compile, train a step."""

import importlib.metadata

import pytest
import torch
from helpers import TINY, compile_caches_off

import moepass
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.options import DEFAULT_PASSES

# the debug model at the harness tests' widths and tokens (TINY, [2, 32]: their Inductor kernels are compiled once a
# run), one dense and two MoE layers: each per-layer count still spans several MoE layers, in 3/4 of the flavor's graph
N_LAYERS = 3
MOE_LAYERS = N_LAYERS - 1  # debug: the first layer dense


@pytest.fixture(scope="module")
def trained_step():
    """One compiled forward/backward/AdamW step of the debug model, with the report of its compile."""
    torch.manual_seed(0)
    model = build_model("debug", **{**TINY, "n_layers": N_LAYERS})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 32))
    compiled = torch.compile(model, backend="moepass")
    # the report's compiled-graph audit runs only when Inductor really compiles (not on a warm cache hit)
    with moepass.collecting() as report, compile_caches_off():
        loss = next_token_loss(compiled(tokens), tokens)
        loss.backward()
    opt.step()
    return model, before, loss, report


def test_entry_point_registers_backend():
    names = [ep.name for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")]
    assert "moepass" in names
    assert "moepass" in torch._dynamo.list_backends()


def test_one_graph_no_breaks(trained_step):
    _, _, _, report = trained_step
    d = report.to_dict()
    assert d["graphs"] == 1 and report.graph_breaks == 0


def test_every_eligible_grouped_gemm_rewritten(trained_step):
    _, _, _, report = trained_step
    d = report.to_dict()
    grouped = {p["name"]: p for p in d["passes"]}["grouped_mm"]
    assert d["ops_before"]["_grouped_mm"] == 3 * MOE_LAYERS
    assert grouped["replaced"] == 3 * MOE_LAYERS and grouped["skipped"] == []
    assert "_grouped_mm" not in d["ops_after"]
    assert set(grouped["implementations"]) == {"emulated"}


def test_every_eligible_linear_rewritten_router_and_head_skipped(trained_step):
    _, _, _, report = trained_step
    d = report.to_dict()
    linear = {p["name"]: p for p in d["passes"]}["linear"]
    skipped = {s["module"]: s["reason"] for s in linear["skipped"]}
    assert set(skipped) == {*(f"layers.{i}.moe.router.gate" for i in range(1, N_LAYERS)), "output"}
    assert all("router gate" in r for m, r in skipped.items() if "router" in m)
    assert "output head" in skipped["output"]
    assert linear["replaced"] == d["ops_before"]["linear"] - (MOE_LAYERS + 1)
    assert d["ops_after"]["linear"] == MOE_LAYERS + 1  # exactly the routers and the head stay F.linear


def test_backward_graph_holds_quantized_dgrad_and_wgrad(trained_step):
    _, _, _, report = trained_step
    backward = [c["ops"] for c in report.compiled if c["kind"] == "backward"]
    assert len(backward) == 1
    ops = backward[0]
    for op in ("mxfp8_linear_dgrad", "mxfp8_linear_wgrad", "mxfp8_grouped_mm_dgrad", "mxfp8_grouped_mm_wgrad"):
        assert ops.get(f"moepass.{op}", 0) > 0, (op, ops)
    assert ops["moepass.mxfp8_grouped_mm_wgrad"] == 3 * MOE_LAYERS  # w1, w3, w2 of each MoE layer


def test_training_step_gives_every_parameter_a_gradient_and_updates_gemm_weights(trained_step):
    model, before, loss, _ = trained_step
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        if p.dim() >= 2:  # norm weights at 1.0 move less than one bf16 ulp in one step at lr 1e-3
            assert not torch.equal(p, before[name]), f"{name} did not change after an AdamW step"


def test_report_save_writes_json_code_and_html(trained_step, tmp_path):
    _, _, _, report = trained_step
    html = report.save(str(tmp_path))
    files = {p.name for p in tmp_path.iterdir()}
    last = f"graph_0_{len(DEFAULT_PASSES)}_after_linear.py"  # graph_<graph>_<pass number>_after_<pass>.py
    assert {"report.json", "report.html", "graph_0_0_before.py", last} <= files
    text = open(html).read()
    assert "router gate" in text and "moepass.mxfp8_grouped_mm" in text and "<script" not in text


def test_linear_fed_straight_from_another_linear_is_rewritten_too():
    """`b(a(x))` (a low-rank pair, a LoRA adapter): the second linear's input is the first one's node, which the
    first rewrite replaces; the second rewrite must take the new node (it once took the erased one)."""
    import torch.nn.functional as F

    import moepass

    torch.manual_seed(0)
    a, b = torch.randn(64, 96).to(torch.bfloat16) / 10, torch.randn(96, 64).to(torch.bfloat16) / 10
    x = torch.randn(16, 96).to(torch.bfloat16)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        got = torch.compile(lambda x: F.linear(F.linear(x, a), b) + x, backend="moepass",
                            options={"inductor": False})(x)
    (linear,) = [p for p in report.to_dict()["passes"] if p["name"] == "linear"]
    assert linear["replaced"] == 2, linear
    want = F.linear(F.linear(x.float(), a.float()), b.float()) + x.float()
    assert ((got.float() - want).norm() / want.norm()).item() < 0.05  # two MXFP8 GEMMs
