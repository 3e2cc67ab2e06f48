"""Models moepass did not write, run as their authors wrote them, trained through backend="moepass" (issue 42).

- DeepSeek-V3's reference `inference/model.py` + `kernel.py` (tests/fixtures/independent/deepseek_v3_reference.py loads the
  copies in tests/fixtures/assets/): a Python loop over the experts, on `bincount(...).tolist()` counts, skipping empty ones;
  MLA in both attention modes ("naive": wkv_b is a linear; "absorb": wkv_b's weight is read per head by einsums).
- torchtune's MoE (tests/fixtures/independent/torchtune_moe.py, copies in tests/fixtures/assets/): on CPU its GroupedExperts loops
  `torch.matmul(x_e, W_e)` over `torch.split(x, counts.tolist())`, W_e a [K, N] slice of a 3-D parameter.
- HF transformers' DeepseekV3 with `experts_implementation="eager"`: the class's own per-expert loop, beside the
  grouped_mm default that tests/integration/test_hf_families.py trains. Dynamo cannot compile that loop (it iterates over a
  `nonzero()` tensor): its frame runs eagerly, its GEMMs never reach moepass, and the report must say so.
(The same under DistributedDataParallel: tests/integration/test_ddp.py.)

Each model trains STEPS AdamW steps compiled with moepass, and again uncompiled in BF16 from the same weights:
- the losses agree within LOSS_RTOL at every step and fall: MXFP8 (emulated on CPU) moved these tiny models' losses
  by up to 1.9% a step (AdamW's first updates are close to sign(grad), which turns gradient noise into whole steps);
- the first step's graphs hold exactly EXPECTED's weight GEMMs: every one in low precision but the router gates and
  the output head, kept BF16 under their skip codes, the head reported under its module path;
- no graph of any step holds a GEMM the report does not account for, nor one kept BF16 for another reason (absorb's
  per-head einsums are: no low-precision op serves a per-head batch; listed as BATCHED_GEMM).
CI runs the rewritten graphs eagerly (options inductor=False: the passes rewrite exactly as with Inductor, a 2-core
CPU skips Inductor's compile); `-m extended` runs moepass's full Inductor path against backend="inductor".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Callable

import pytest
import torch

import moepass
from moepass.report import coverage

import deepseek_v3_reference
import torchtune_moe

STEPS = 3
LR = 3e-4
LOSS_RTOL = 0.05
PASSES_ONLY = {"inductor": False}
ROUTER_GATE, OUTPUT_HEAD, BATCHED_GEMM = "ROUTER_GATE", "OUTPUT_HEAD", "BATCHED_GEMM"

transformers = pytest.importorskip("transformers")
# transformers' dispatch calls lru_cache'd version checks: Dynamo warns once per model and traces them
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning")


@dataclasses.dataclass(frozen=True)
class Expected:
    """What the graphs of the first training step hold (forward; each GEMM counted once per graph node)."""
    gemms: int  # GEMMs on a weight
    bf16: dict[str, int]  # skip code -> GEMMs kept BF16 for it
    head: str  # module path of the output head
    router: str  # module-path suffix of every router gate
    not_weight: int  # activation GEMMs (attention), outside the coverage
    batched_op: str = ""  # the op of every BATCHED_GEMM (a per-head product on a stacked weight)


EXPECTED = {
    # attention wq_a, wq_b, wkv_a, wkv_b, wo (x2 layers) + dense MLP 3 + router 1 + one graph of 8 experts x 3 and the
    # shared expert's 3 + head 1; einsums q.k and scores.v (x2 layers) read no weight
    "deepseek_v3_reference_naive": Expected(42, {ROUTER_GATE: 1, OUTPUT_HEAD: 1}, "head", "ffn.gate", not_weight=4),
    # wkv_b's weight read per head by two einsums a layer instead of once as a linear (no low-precision op serves a
    # per-head batch: kept BF16 under its code); three activation einsums a layer
    "deepseek_v3_reference_absorb": Expected(44, {ROUTER_GATE: 1, OUTPUT_HEAD: 1, BATCHED_GEMM: 4}, "head", "ffn.gate",
                                             not_weight=6, batched_op="einsum"),
    # per layer: attention q, k, v, output 4 + router 1 + 8 experts x 3 matmuls + shared expert 3; head 1; SDPA x2
    "torchtune_moe": Expected(65, {ROUTER_GATE: 2, OUTPUT_HEAD: 1}, "output", "mlp.router.gate", not_weight=2),
    # attention 5, router 1, shared experts 3 (the routed experts run eagerly), lm_head 1; SDPA
    "hf_deepseek_v3_eager_experts": Expected(10, {ROUTER_GATE: 1, OUTPUT_HEAD: 1}, "lm_head", "mlp.gate",
                                             not_weight=1),
}


# ---------------------------------------------------------------- the models, as a training step sees them


@dataclasses.dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    loss: Callable[[torch.nn.Module, Callable], torch.Tensor]  # (model, its compiled or plain callable) -> loss
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def deepseek_v3_reference_case(attn_impl: str) -> Case:
    tokens, targets = deepseek_v3_reference.example_tokens()

    def loss(model, run):
        deepseek_v3_reference.forget_caches(model)  # inference KV caches: cut from the last step's graph
        return deepseek_v3_reference.loss_fn(run, tokens, targets)

    return Case(lambda: deepseek_v3_reference.build(attn_impl), loss)


def torchtune_moe_case() -> Case:
    ids = torchtune_moe.example_ids()
    return Case(torchtune_moe.build, lambda model, run: torchtune_moe.loss_fn(run, ids),
                torchtune_moe.integer_histc_on_cpu)


# test_hf_families.py's DeepseekV3 sizes, one MoE layer only (Dynamo's tracing of the eager loop sets the test's time)
HF_DEEPSEEK_V3 = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=4, use_cache=False, attn_implementation="sdpa", n_routed_experts=8,
                      num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=0,
                      moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                      qk_rope_head_dim=32, v_head_dim=16)


def hf_deepseek_v3(experts_implementation: str) -> torch.nn.Module:
    cfg = transformers.DeepseekV3Config(**HF_DEEPSEEK_V3, experts_implementation=experts_implementation)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)


def hf_eager_experts_case() -> Case:
    ids = torch.randint(0, HF_DEEPSEEK_V3["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    return Case(lambda: hf_deepseek_v3("eager"), lambda model, run: run(input_ids=ids, labels=ids).loss)


CASES = {
    "deepseek_v3_reference_naive": lambda: deepseek_v3_reference_case("naive"),
    "deepseek_v3_reference_absorb": lambda: deepseek_v3_reference_case("absorb"),
    "torchtune_moe": torchtune_moe_case,
    "hf_deepseek_v3_eager_experts": hf_eager_experts_case,
}


# ---------------------------------------------------------------- training and what the reports say


@dataclasses.dataclass
class Run:
    losses: list[float]
    reports: list  # moepass's Report of each step (the graphs that ran in it); [] when not compiled with moepass


def train(case: Case, backend: str, options: dict | None = None) -> Run:
    """STEPS AdamW steps of a freshly built model: uncompiled ("eager"), or compiled with `backend`."""
    torch._dynamo.reset()
    with case.context():
        model = case.build()
        run = model if backend == "eager" else torch.compile(model, backend=backend, options=options)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, reports = [], []
        for _ in range(STEPS):
            with moepass.collecting() as report:
                loss = case.loss(model, run)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            reports.append(report)
    return Run(losses, reports if backend == "moepass" else [])


def gemm_uses(report) -> list:
    return [use for graph in report.graphs for use in graph.gemms]


def assert_losses_agree(got: Run, want: Run):
    assert all(math.isfinite(loss) for loss in got.losses), got.losses
    assert got.losses[-1] < got.losses[0], f"did not train: {got.losses}"
    for step, (g, w) in enumerate(zip(got.losses, want.losses)):
        assert g == pytest.approx(w, rel=LOSS_RTOL), f"step {step}: {g} vs {w} (all: {got.losses} vs {want.losses})"


def assert_first_step_coverage(report, expected: Expected):
    cov = report.coverage()
    assert cov["unaccounted"] == 0, cov["unaccounted_gemms"]
    assert cov["not_weight"] == expected.not_weight
    assert cov["gemms"] == expected.gemms, cov
    assert cov["bf16"] == expected.bf16, cov
    assert cov["low_precision"] == expected.gemms - sum(expected.bf16.values()), cov


def assert_every_gemm_accounted(reports, expected: Expected):
    """Every step's graphs: no unaccounted GEMM; the router and head rules keep BF16 exactly the router gates and the
    head; any other BF16 GEMM is a per-head product (absorb's einsums)."""
    for step, report in enumerate(reports):
        for use in gemm_uses(report):
            where = f"step {step}: {use}"
            assert use.status != coverage.UNACCOUNTED, where
            if use.status == coverage.NOT_WEIGHT:
                continue
            is_router, is_head = use.module.endswith(expected.router), use.module == expected.head
            assert (use.code == ROUTER_GATE) == is_router and (use.code == OUTPUT_HEAD) == is_head, where
            if use.status == coverage.BF16 and not (is_router or is_head):
                assert use.code == BATCHED_GEMM and use.op == expected.batched_op, where


def check_against_eager(name: str):
    case = CASES[name]()
    got, want = train(case, "moepass", PASSES_ONLY), train(case, "eager")
    assert_losses_agree(got, want)
    assert_first_step_coverage(got.reports[0], EXPECTED[name])
    assert_every_gemm_accounted(got.reports, EXPECTED[name])
    return got


# ---------------------------------------------------------------- CI


@pytest.mark.parametrize("attn_impl", ["naive", "absorb"])
def test_deepseek_v3_reference_model_trains_rewritten(attn_impl):
    got = check_against_eager(f"deepseek_v3_reference_{attn_impl}")
    experts = [use for use in gemm_uses(got.reports[0]) if ".ffn.experts." in use.module]
    every_expert = {f"layers.1.ffn.experts.{e}.{w}" for e in range(8) for w in ("w1", "w2", "w3")}
    assert {use.module for use in experts} == every_expert
    assert {use.status for use in experts} == {coverage.LOW_PRECISION}


def test_torchtune_moe_trains_with_its_expert_matmuls_rewritten():
    got = check_against_eager("torchtune_moe")
    experts = [use for use in gemm_uses(got.reports[0]) if use.module.endswith("mlp.experts")]
    assert len(experts) == 2 * 8 * 3 and {use.status for use in experts} == {coverage.LOW_PRECISION}
    assert {use.weight for use in experts} == {"gate_proj", "up_proj", "down_proj"}


@pytest.mark.extended  # a minute on CI's 2 cores; CI keeps the grouped_mm default (tests/integration/test_hf_families.py)
def test_hf_eager_experts_loop_runs_eagerly_and_the_report_says_so():
    got = check_against_eager("hf_deepseek_v3_eager_experts")
    first = got.reports[0]
    assert not [use for use in gemm_uses(first) if ".mlp.experts" in use.module]  # the loop never reached moepass
    assert first.to_dict()["frames_run_eagerly"] > 0
    assert "fell back to eager" in first.summary()


# ---------------------------------------------------------------- extended: the whole Inductor path


@pytest.mark.extended
@pytest.mark.parametrize("name", list(CASES))
def test_unseen_model_matches_inductor(name):
    """moepass's passes and Inductor against backend="inductor" from the same weights (~2-4 min each on 2 cores)."""
    case = CASES[name]()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex")
        got, want = train(case, "moepass"), train(case, "inductor")
    assert_losses_agree(got, want)
    assert_first_step_coverage(got.reports[0], EXPECTED[name])
    assert_every_gemm_accounted(got.reports, EXPECTED[name])
