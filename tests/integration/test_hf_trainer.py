"""Hugging Face `Trainer` (transformers 5.23, accelerate 1.16.0) training through moepass, on CPU.

accelerate compiles the model itself and takes only the backend names of its `DynamoBackend` enum, so
`TrainingArguments(torch_compile_backend="moepass")` fails when the Trainer is built. The documented line:

    moepass.inductor_route.install()   # once, before Trainer(...); then TrainingArguments(torch_compile=True)

(backend "inductor", accelerate's own default: moepass runs as Inductor's pre-grad pass). The other route,
`torch.compile(model, backend="moepass")` handed to Trainer, needs `remove_unused_columns=False`: Trainer reads the
compiled wrapper's `forward(*args, **kwargs)` and would drop every column of the batch.

Checked on transformers' tiny DeepSeek-V3 and Qwen3-MoE (tests/integration/test_hf_families.py's configs cut to one MoE
layer, BF16), two Trainer steps on the same weights and batches: through the route, every grouped GEMM and the family's
linears are rewritten to moepass ops in one graph, and each step's loss matches plain `backend="inductor"` within the
recipe's noise; the route is removed afterwards. Inductor-CPU compiles are the slow part: Qwen3-MoE runs with
`pytest -m extended`.

`TrainingArguments(bf16=True)` on an FP32-loaded DeepSeek-V3 (the last section) runs each step under autocast: the
linears are rewritten, HF's experts run in FP32 (kept, with the reason), and losses match Inductor's the same way.
"""

from __future__ import annotations

import math

import pytest
import torch

import moepass
from moepass import inductor_route
from test_hf_families import FAMILIES, LRU_CACHE_WARNING, MXFP8_OPTIONS, TINY
from test_hf_families import build as build_family

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

pytestmark = pytest.mark.filterwarnings(f"ignore:{LRU_CACHE_WARNING}:UserWarning")

# two steps: the second runs the compiled step again, on the weights the first optimizer step updated; a third
# repeats that
STEPS, BATCH, SEQ = 2, 2, 64
# measured: per-step loss gaps <= 1.9e-4 (MXFP8 emulated vs BF16; plain eager vs Inductor differ by ~1e-4 too); the 5%
# of test_hf_families (one untrained step) would pass any model near ln(vocab) at init
LOSS_RTOL = 2e-3
GRAD_NORM_RTOL = 0.05  # BF16 grad norms: measured gaps <= 1.4%

# One MoE layer: test_hf_families trains the two-layer configs (DeepSeek-V3's first layer dense, whose MLP is the
# shared expert's class); what Trainer and the route add holds per layer, and each Inductor-CPU compile costs about a
# second per distinct kernel (the DeepSeek-V3 pair: 60 kernels at two layers, 47 at one)
ONE_MOE_LAYER = {"DeepseekV3": {"num_hidden_layers": 1, "first_k_dense_replace": 0},
                 "Qwen3Moe": {"num_hidden_layers": 1}}
# at one MoE layer: (grouped GEMMs, linears rewritten): DeepSeek-V3's 5 MLA projections and its shared expert's 3;
# Qwen3-MoE's q, k, v, o. The router gate and lm_head stay BF16 (test_hf_families' rules)
REWRITES = {"DeepseekV3": (2, 8), "Qwen3Moe": (2, 4)}


def build(name: str):
    """The family's model at TINY sizes with one MoE layer, in BF16, seeded."""
    return build_family(name, **ONE_MOE_LAYER[name])


class TokenRows(torch.utils.data.Dataset):
    """Next-token batches as Trainer's default collator takes them: one row of ids, its own labels."""

    def __init__(self, vocab_size: int):
        self.ids = torch.randint(0, vocab_size, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(tmp_path, **kwargs):
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True,
                                          max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
                                          logging_steps=1, seed=0, disable_tqdm=True, **kwargs)


def train(model, args):
    """Trainer's steps on the same batches; (per-step losses, grad norms, moepass's report of the run, trainer)."""
    torch._dynamo.reset()
    with moepass.collecting() as report:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenRows(model.config.vocab_size))
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return [e["loss"] for e in logs], [e["grad_norm"] for e in logs], report, trainer


@pytest.fixture
def route_removed_after(monkeypatch):
    """The route is process-wide Inductor config: never let it outlive the test (xdist runs other files after)."""
    monkeypatch.delenv("MOEPASS_OPTIONS", raising=False)  # install() with no argument: moepass's defaults
    try:
        yield
    finally:
        inductor_route.uninstall()
    assert inductor_route.installed() is None
    assert torch._inductor.config.pre_grad_custom_pass is None


def assert_rewritten(name: str, report) -> None:
    """One graph, every grouped GEMM and the family's linears rewritten to moepass ops (whatever the recipe)."""
    (grouped, linears), d = REWRITES[name], report.to_dict()
    assert (d["graphs"], report.graph_breaks) == (1, 0)
    replaced = {p["name"]: p["replaced"] for p in d["passes"]}
    assert d["ops_before"]["_grouped_mm"] == grouped and "_grouped_mm" not in d["ops_after"]
    assert (replaced["grouped_mm"], replaced["linear"]) == (grouped, linears)
    ops = {op: n for op, n in d["ops_after"].items() if op.startswith("moepass.")}
    assert sum(n for op, n in ops.items() if op.endswith("_grouped_mm")) == grouped, ops
    assert sum(n for op, n in ops.items() if op.endswith("_linear")) == linears, ops


def assert_compiled_by_accelerate(trainer) -> None:
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.parametrize("name", [
    "DeepseekV3",
    pytest.param("Qwen3Moe", marks=pytest.mark.extended),  # a second Inductor-CPU pair of compiles
])
def test_trainer_through_the_inductor_route_matches_plain_inductor(name, tmp_path, route_removed_after):
    plain = training_args(tmp_path / "inductor", torch_compile=True)
    base_losses, base_grad_norms, base_report, base = train(build(name), plain)
    assert base.args.torch_compile_backend == "inductor"
    assert_compiled_by_accelerate(base)
    assert base_report.to_dict()["graphs"] == 0  # moepass saw nothing: the route is not installed

    inductor_route.install()  # the documented line
    losses, grad_norms, report, trainer = train(build(name), training_args(tmp_path / "route", torch_compile=True))
    inductor_route.uninstall()

    assert_compiled_by_accelerate(trainer)
    assert_rewritten(name, report)
    assert len(losses) == STEPS and all(map(math.isfinite, losses + grad_norms))
    assert losses == pytest.approx(base_losses, rel=LOSS_RTOL)
    assert grad_norms == pytest.approx(base_grad_norms, rel=GRAD_NORM_RTOL)


@pytest.mark.extended  # CI keeps the documented route above and this route's remove_unused_columns check below
def test_trainer_with_a_model_compiled_by_moepass(tmp_path):
    """The model compiled with backend="moepass" before Trainer sees it (Inductor off to keep CI fast: the passes
    rewrite the same graph); Trainer leaves a compiled model alone. Losses within the recipe's noise of eager."""
    name = "DeepseekV3"
    eager_losses, eager_grad_norms, _, _ = train(build(name), training_args(tmp_path / "eager"))
    compiled = torch.compile(build(name), backend="moepass", options=MXFP8_OPTIONS)
    losses, grad_norms, report, trainer = train(compiled, training_args(tmp_path / "moepass",
                                                                          remove_unused_columns=False))
    assert trainer.model_wrapped is compiled
    assert_rewritten(name, report)
    assert all(map(math.isfinite, losses + grad_norms))
    assert losses == pytest.approx(eager_losses, rel=LOSS_RTOL)
    assert grad_norms == pytest.approx(eager_grad_norms, rel=GRAD_NORM_RTOL)


def test_a_model_compiled_by_moepass_needs_remove_unused_columns_false(tmp_path):
    """Trainer's default keeps the batch columns named in the forward's signature: the compiled wrapper's is
    (*args, **kwargs), so every column goes and the first step refuses the empty batch (before any compile)."""
    compiled = torch.compile(build("DeepseekV3"), backend="moepass", options=MXFP8_OPTIONS)
    with pytest.raises(ValueError, match="The batch received was empty"):
        train(compiled, training_args(tmp_path))


def test_accelerate_refuses_the_backend_name(tmp_path):
    """What the docs say: accelerate takes only its DynamoBackend names (TrainingArguments itself accepts it)."""
    args = training_args(tmp_path, torch_compile=True, torch_compile_backend="moepass")
    with pytest.raises(ValueError, match="'MOEPASS' is not a valid DynamoBackend"):
        transformers.Trainer(model=build("DeepseekV3"), args=args, train_dataset=TokenRows(256))


# ---------------------------------------------------------------- Trainer(bf16=True) on FP32 weights

# DeepSeek-V3 under Trainer(bf16=True) on FP32 weights: autocast runs the 8 linears (one MoE layer) in BF16 and moepass
# rewrites them (the router gate and lm_head kept BF16 as on a BF16 model). HF's experts cast their input to the
# weight's dtype and autocast does not cast torch._grouped_mm, so the 2 expert GEMMs run in FP32, and are kept so, with
# code NOT_BF16.
AUTOCAST_LINEARS, AUTOCAST_KEPT = REWRITES["DeepseekV3"][1], {"NOT_BF16": 2, "OUTPUT_HEAD": 1, "ROUTER_GATE": 1}


def build_fp32(name: str):
    """build(name) as `from_pretrained` loads it by default: FP32 weights, seeded."""
    cfg = getattr(transformers, f"{name}Config")(**{**TINY, **FAMILIES[name].config, **ONE_MOE_LAYER[name]})
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(cfg)


def assert_rewritten_under_autocast(report) -> None:
    d, cov = report.to_dict(), report.coverage()
    assert (d["graphs"], report.graph_breaks) == (1, 0)
    replaced = {p["name"]: p["replaced"] for p in d["passes"]}
    assert (replaced["grouped_mm"], replaced["linear"]) == (0, AUTOCAST_LINEARS), replaced
    assert (cov["low_precision"], cov["bf16"], cov["unaccounted"]) == (AUTOCAST_LINEARS, AUTOCAST_KEPT, 0), cov
    experts = [s for p in d["passes"] if p["name"] == "grouped_mm" for s in p["skipped"]]
    assert len(experts) == 2 and all("autocast" in s["reason"] for s in experts), experts  # the reason names it


def test_trainer_bf16_on_fp32_weights_through_the_inductor_route(tmp_path, route_removed_after):
    """Trainer(bf16=True) on an FP32-loaded model: accelerate wraps the forward in torch.autocast(bfloat16) and then
    compiles it, so the region is entered inside the compiled function. Losses within the recipe's noise of plain
    Inductor under the same Trainer; the weights stay FP32."""
    plain = training_args(tmp_path / "inductor", torch_compile=True, bf16=True)
    base_losses, base_grad_norms, _, _ = train(build_fp32("DeepseekV3"), plain)

    inductor_route.install()
    model = build_fp32("DeepseekV3")
    losses, grad_norms, report, trainer = train(model, training_args(tmp_path / "route", torch_compile=True, bf16=True))
    inductor_route.uninstall()

    assert_compiled_by_accelerate(trainer)
    assert_rewritten_under_autocast(report)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len(losses) == STEPS and all(map(math.isfinite, losses + grad_norms))
    assert losses == pytest.approx(base_losses, rel=LOSS_RTOL)
    assert grad_norms == pytest.approx(base_grad_norms, rel=GRAD_NORM_RTOL)


def test_trainer_bf16_on_fp32_weights_with_a_model_compiled_by_moepass(tmp_path):
    """The model compiled with backend="moepass" before Trainer(bf16=True): accelerate's autocast wraps the compiled
    call (entered around it). Inductor off to keep it quick; losses within the recipe's noise of the same Trainer
    uncompiled."""
    eager_losses, eager_grad_norms, _, _ = train(build_fp32("DeepseekV3"), training_args(tmp_path / "eager", bf16=True))
    compiled = torch.compile(build_fp32("DeepseekV3"), backend="moepass", options=MXFP8_OPTIONS)
    losses, grad_norms, report, trainer = train(compiled, training_args(tmp_path / "moepass", bf16=True,
                                                                          remove_unused_columns=False))
    assert trainer.model_wrapped is compiled
    assert_rewritten_under_autocast(report)
    assert all(map(math.isfinite, losses + grad_norms))
    assert losses == pytest.approx(eager_losses, rel=LOSS_RTOL)
    assert grad_norms == pytest.approx(eager_grad_norms, rel=GRAD_NORM_RTOL)
