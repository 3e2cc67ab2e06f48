"""Every MoE family of Hugging Face transformers 5.23, unmodified, trained one step through backend="moepass".

Each family is built from its own Config class at tiny sizes and runs its experts through transformers'
default `experts_implementation="grouped_mm"` (one `torch._grouped_mm` per expert GEMM). The test asserts
one graph, finite loss and gradients, the loss within 5% of the uncompiled BF16 model (MXFP8 is emulated
on CPU), and the exact rewrite counts of FAMILIES below.

Compiled with options={"inductor": False}: the passes rewrite the graph exactly as with Inductor, but the
rewritten graph then runs eagerly, which keeps CI time low (Inductor-CPU compiles are the slow part).

`python tests/integration/test_hf_families.py` prints docs/integrations.md's "families and their rewrite counts" table from a
live run of every family; test_docs_table_holds_the_tested_counts keeps that table equal to FAMILIES.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import pathlib
import warnings

import pytest
import torch

import moepass
from moepass.report.coverage import BF16, LOW_PRECISION
from moepass.skips import SkipCode

transformers = pytest.importorskip("transformers")

# transformers' grouped_mm dispatch calls lru_cache'd version checks; Dynamo warns once per family and traces them
LRU_CACHE_WARNING = "Dynamo detected a call to a `functools.lru_cache`"
pytestmark = pytest.mark.filterwarnings(f"ignore:{LRU_CACHE_WARNING}:UserWarning")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, use_cache=False, attn_implementation="sdpa")
"""Shared by every family; each family's own names for experts, top-k and MoE sizes are in FAMILIES."""

ROUTER = "router gate"
OUTPUT_HEAD = "output head"
MXFP8_OPTIONS = {"inductor": False}
LOSS_RTOL = 0.05


@dataclasses.dataclass(frozen=True)
class Family:
    config: dict  # overrides of TINY, in the family's own config names
    router: str  # module-path suffix of the router gate linear
    moe_layers: int
    grouped_per_moe_layer: int  # torch._grouped_mm nodes per MoE layer (forward graph)
    linears_rewritten: int
    kept_bf16: dict  # why -> how many linears stay BF16


# every MLA GEMM dimension a multiple of 32, as in the published configs (kv_a: N = kv_lora_rank + rope = 64)
_MLA = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16)

FAMILIES: dict[str, Family] = {
    # 1 dense layer then 1 MoE layer: attention q_a, q_b, kv_a, kv_b, o (5/layer) + dense MLP 3 + shared expert 3
    "DeepseekV3": Family(dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                              first_k_dense_replace=1, moe_intermediate_size=32, **_MLA),
                         "mlp.gate", moe_layers=1, grouped_per_moe_layer=2, linears_rewritten=16,
                         kept_bf16={ROUTER: 1, OUTPUT_HEAD: 1}),
    "DeepseekV2": Family(dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                              **_MLA),
                         "mlp.gate", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=16,
                         kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    # 32 experts: the router's N=32 passes the MXFP8 shape rule, so only the router rule keeps it BF16
    "Qwen3Moe": Family(dict(num_experts=32, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
                       "mlp.gate", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=8,
                       kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    "Qwen2Moe": Family(dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64),
                       "mlp.gate", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=14,
                       kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1, "mxfp8: N=1 not a multiple of 32": 2}),
    "Mixtral": Family(dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16),
                      "mlp.gate", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=8,
                      kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    # the default eos_token_id=50279 lies outside the tiny vocabulary (transformers warns)
    "Olmoe": Family(dict(num_experts=8, num_experts_per_tok=2, eos_token_id=2),
                    "mlp.gate", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=8,
                    kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    # attention sinks: transformers refuses sdpa for GptOss
    "GptOss": Family(dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16, attn_implementation="eager"),
                     "mlp.router", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=8,
                     kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    "Glm4Moe": Family(dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                           first_k_dense_replace=1, moe_intermediate_size=32, head_dim=16),
                      "mlp.gate", moe_layers=1, grouped_per_moe_layer=2, linears_rewritten=14,
                      kept_bf16={ROUTER: 1, OUTPUT_HEAD: 1}),
    "Phimoe": Family(dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16),
                     "mlp.router", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=8,
                     kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    "GraniteMoe": Family(dict(num_local_experts=8, num_experts_per_tok=2),
                         "block_sparse_moe.router", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=8,
                         kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
    "Ernie4_5_Moe": Family(dict(moe_num_experts=8, moe_k=2, moe_num_shared_experts=1, moe_intermediate_size=32,
                                moe_layer_start_index=1),
                           "mlp.gate", moe_layers=1, grouped_per_moe_layer=2, linears_rewritten=14,
                           kept_bf16={ROUTER: 1, OUTPUT_HEAD: 1}),
    "Dots1": Family(dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                         head_dim=16),
                    "mlp.gate", moe_layers=2, grouped_per_moe_layer=2, linears_rewritten=14,
                    kept_bf16={ROUTER: 2, OUTPUT_HEAD: 1}),
}


def build(name: str, **config_overrides):
    """The family's XxxForCausalLM at TINY sizes, in BF16, seeded."""
    cfg = getattr(transformers, f"{name}Config")(**{**TINY, **FAMILIES[name].config, **config_overrides})
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(cfg).to(torch.bfloat16)


def example_ids(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))


def why_kept(reason: str) -> str:
    """A skip reason shortened to its kind: the router and output-head rules, else the whole reason."""
    for kind in (ROUTER, OUTPUT_HEAD):
        if reason.startswith(kind):
            return kind
    return reason


@dataclasses.dataclass
class FamilyRun:
    model: torch.nn.Module
    report: dict
    graph_breaks: int
    loss: float
    eager_loss: float
    missing_grads: list[str]
    nonfinite_grads: list[str]
    nonfinite_after_step: list[str]

    def pass_record(self, name: str) -> dict:
        return next(p for p in self.report["passes"] if p["name"] == name)

    @property
    def linear_skips(self) -> dict[str, str]:
        return {s["module"]: s["reason"] for s in self.pass_record("linear")["skipped"]}

    @property
    def kept_bf16(self) -> dict[str, int]:
        return dict(collections.Counter(why_kept(r) for r in self.linear_skips.values()))

    @property
    def moe_layers(self) -> int:
        return sum(name.endswith(".experts") for name, _ in self.model.named_modules())


def train_step(name: str) -> FamilyRun:
    """One SGD step of the family compiled with moepass, and the uncompiled model's loss on the same batch."""
    torch._dynamo.reset()
    model = build(name)
    ids = example_ids(model)
    torch.manual_seed(2)  # PhiMoE samples its experts in training: same draws for both runs
    with torch.no_grad():
        eager_loss = model(input_ids=ids, labels=ids).loss.item()
    compiled = torch.compile(model, backend="moepass", options=MXFP8_OPTIONS)
    torch.manual_seed(2)
    with moepass.collecting() as report:
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing = [n for n, p in params if p.grad is None]
    nonfinite = [n for n, p in params if p.grad is not None and not torch.isfinite(p.grad).all()]
    torch.optim.SGD(model.parameters(), lr=1e-2).step()
    return FamilyRun(model, report.to_dict(), report.graph_breaks, loss.item(), eager_loss, missing, nonfinite,
                     [n for n, p in params if not torch.isfinite(p).all()])


def test_families_use_grouped_mm_experts_by_default():
    for name in FAMILIES:
        assert build(name).get_experts_implementation() == {"": "grouped_mm"}, name


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_one_step_with_its_expected_rewrites(name):
    family, run = FAMILIES[name], train_step(name)
    d = run.report
    assert (d["graphs"], run.graph_breaks) == (1, 0)
    assert math.isfinite(run.loss)
    assert run.missing_grads == [] and run.nonfinite_grads == [] and run.nonfinite_after_step == []
    assert run.loss == pytest.approx(run.eager_loss, rel=LOSS_RTOL)

    assert run.moe_layers == family.moe_layers
    grouped = run.pass_record("grouped_mm")
    assert d["ops_before"]["_grouped_mm"] == family.moe_layers * family.grouped_per_moe_layer
    assert grouped["replaced"] == d["ops_before"]["_grouped_mm"] and grouped["skipped"] == []

    linear, skips = run.pass_record("linear"), run.linear_skips
    assert all(skips.values())
    assert linear["replaced"] + len(linear["skipped"]) == d["ops_before"]["linear"]
    assert (linear["replaced"], run.kept_bf16) == (family.linears_rewritten, family.kept_bf16)
    routers = {m for m, r in skips.items() if why_kept(r) == ROUTER}
    assert routers and all(m.endswith(family.router) for m in routers)
    assert why_kept(skips["lm_head"]) == OUTPUT_HEAD


@pytest.mark.parametrize("name, router_skip", [
    ("Qwen3Moe", None),  # 32 experts: nothing but the router rule kept it BF16
    ("Mixtral", "mxfp8: N=8 not a multiple of 32"),  # 8 experts: the shape rule would keep it BF16 anyway
])
def test_router_rule_off_shows_what_else_keeps_the_router_bf16(name, router_skip):
    model = build(name)
    ids = example_ids(model)
    torch._dynamo.reset()
    report = moepass.inspect(model, input_ids=ids, options={**MXFP8_OPTIONS, "lowp.keep_router_bf16": False})
    linear = next(p for p in report.to_dict()["passes"] if p["name"] == "linear")
    router = FAMILIES[name].router
    skips = {s["module"]: s["reason"] for s in linear["skipped"] if s["module"].endswith(router)}
    assert skips == ({} if router_skip is None else {f"model.layers.{i}.{router}": router_skip for i in range(2)})
    assert linear["replaced"] == FAMILIES[name].linears_rewritten + (2 if router_skip is None else 0)


# FP32 weights (a model loaded in FP32, or FP32 masters under autocast): torch._grouped_mm cannot run them under
# torch.compile, so transformers runs its experts through its own custom op, transformers::grouped_mm_fallback
FALLBACK_OP = "transformers.grouped_mm_fallback"
FALLBACK_SAID = "transformers::grouped_mm_fallback read as torch._grouped_mm: "


@pytest.mark.parametrize("precision", ["fp32", "autocast"])
@pytest.mark.parametrize("name", ["DeepseekV3", "Mixtral"])
def test_fp32_experts_in_transformers_own_op_are_listed_with_no_weight_op_unaccounted(name, precision):
    """Every expert GEMM is listed, rewritten or with its reason, and no op reading a weight is unaccounted."""
    torch._dynamo.reset()
    family, model = FAMILIES[name], build(name).float()
    ids = example_ids(model)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "autocast" else contextlib.nullcontext()
    with region, torch.no_grad():
        eager_loss = model(input_ids=ids, labels=ids).loss.item()
    compiled = torch.compile(model, backend="moepass", options=MXFP8_OPTIONS)
    with region, moepass.collecting() as report:
        loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    d, cov = report.to_dict(), report.coverage()
    experts = family.moe_layers * family.grouped_per_moe_layer
    assert (d["graphs"], d["ops_before"][FALLBACK_OP], cov["unaccounted"]) == (1, experts, 0)
    listed = [u for u in d["gemms"] if u["module"].endswith(".experts")]
    assert len(listed) == experts and {u["weight"] for u in listed} == {"gate_up_proj", "down_proj"}
    for u in listed:  # rewritten by the grouped_mm pass, or still transformers' op with the pass's reason naming it
        assert u["by"] == "grouped_mm" and (u["status"] == LOW_PRECISION or (
            u["status"] == BF16 and u["op"] == FALLBACK_OP and u["note"].startswith(FALLBACK_SAID)
            and SkipCode[u["code"]].phrase in u["note"])), u
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    assert loss.item() == pytest.approx(eager_loss, rel=LOSS_RTOL if precision == "autocast" else 1e-5)


# Llama4's MoE adds its routed experts into its shared expert's output in place (`out.add_(...)`), the output of a
# rewritten linear; its experts are one bmm each (kept BF16 with their reason)
LLAMA4_TEXT = dict(intermediate_size_mlp=64, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                   attention_chunk_size=64)


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=pytest.mark.extended)])  # Inductor: ~1 min
def test_llama4_text_trains_with_an_in_place_add_on_a_rewritten_linears_output(inductor):
    """Three SGD steps of Llama4's text model, with and without Inductor: the code after a moepass op may modify its
    outputs in place (moepass/ops/fresh_outputs.py)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**{**TINY, **LLAMA4_TEXT})).to(torch.bfloat16)
    ids = example_ids(model)
    with torch.no_grad():
        eager_loss = model(input_ids=ids, labels=ids).loss.item()
    compiled = torch.compile(model, backend="moepass", options={**MXFP8_OPTIONS, "inductor": inductor})
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses = []
    with moepass.collecting() as report:
        for _ in range(3):
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    d = report.to_dict()
    assert (d["graphs"], report.graph_breaks) == (1, 0)
    rewritten = {r["module"] for p in d["passes"] if p["name"] == "linear" for r in p["rewrites"]}
    assert {f"model.layers.{i}.feed_forward.shared_expert.down_proj" for i in range(2)} <= rewritten, rewritten
    assert all(math.isfinite(v) for v in losses) and losses[2] < losses[1] < losses[0], losses
    assert losses[0] == pytest.approx(eager_loss, rel=LOSS_RTOL)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# DeepseekV3: halves of one gate_up GEMM, the routing weights after a no-op cast; Mixtral's is the same code path in
# transformers 5, so it runs with the long checks only (CI time)
@pytest.mark.parametrize("name", ["DeepseekV3", pytest.param("Mixtral", marks=pytest.mark.extended)])
def test_swiglu_inputs_fp8_fuses_each_moe_layers_experts_swiglu(name):
    """quantize_once.swiglu_inputs "fp8" on transformers' own expert code: every MoE layer's SwiGLU (halves of one
    gate_up GEMM, the routing weights after a no-op cast) becomes the fused op, and the loss is the default's."""
    model = build(name)
    ids = example_ids(model)
    losses, fused = [], []
    for extra in ({}, {"quantize_once.swiglu_inputs": "fp8"}):
        torch._dynamo.reset()
        with moepass.collecting() as report:
            loss = torch.compile(model, backend="moepass", options={"recipe": "fp8_rowwise", **extra})(
                input_ids=ids, labels=ids).loss
            loss.backward()
        losses.append(loss.item())
        fused.append([r.module for p in report.pass_totals() for r in p.rewrites if r.op.endswith("_swiglu_rows")])
    assert fused[0] == [] and len(fused[1]) == FAMILIES[name].moe_layers, fused
    assert all(module.endswith("mlp.experts") for module in fused[1]), fused
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def families_table() -> str:
    """docs/integrations.md's table, from a live run of every family."""
    rows = ["| family | MoE layers | grouped GEMMs rewritten | linears rewritten | linears kept BF16 (why) |",
            "|---|---|---|---|---|"]
    for name in FAMILIES:
        run = train_step(name)
        kept = ", ".join(f"{n} {why}" for why, n in run.kept_bf16.items())
        rows.append(f"| {name} | {run.moe_layers} | {run.pass_record('grouped_mm')['replaced']} | "
                    f"{run.pass_record('linear')['replaced']} | {kept} |")
    return "\n".join(rows)


def test_docs_table_holds_the_tested_counts():
    """docs/integrations.md's table says what FAMILIES asserts, family by family (no run: the tests above run them)."""
    page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text(encoding="utf-8")
    rows = {}
    for line in page.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in FAMILIES:
            rows[cells[0]] = cells[1:]
    assert sorted(rows) == sorted(FAMILIES)
    for name, family in FAMILIES.items():
        moe_layers, grouped, linears, kept = rows[name]
        assert (int(moe_layers), int(grouped), int(linears)) == (
            family.moe_layers, family.moe_layers * family.grouped_per_moe_layer, family.linears_rewritten), name
        assert sorted(kept.split(", ")) == sorted(f"{n} {why}" for why, n in family.kept_bf16.items()), name


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message=LRU_CACHE_WARNING)
    print(families_table())
