"""PyTorch Lightning (pytorch-lightning 2.6.6) training a one-MoE-layer DeepSeek-V3 through moepass, on CPU.

Lightning's own idiom compiles the LightningModule and hands the result to `Trainer.fit`:

    trainer.fit(torch.compile(module, backend="moepass"))

Lightning unwraps it (`pytorch_lightning.utilities.compile.from_compiled`) and compiles the module's `forward` and
`training_step` with the same backend, so the loss is in moepass's graph. Compiling the inner model before fit
(`module.model = torch.compile(module.model, backend="moepass")`) works as well. Neither needs anything else.

`precision="bf16-mixed"` keeps the FP32 weights and runs `training_step` under `torch.autocast("cpu", bfloat16)`,
entered around the compiled call; moepass rewrites the GEMMs autocast runs in BF16 and quantizes the FP32 master
weights straight to MXFP8. `precision="bf16-true"` converts the module to BF16 before the first step. Either way
the expert grouped GEMMs and the linears are rewritten as on a BF16 model, the FP32 (bf16-mixed) or BF16
(bf16-true) parameters get gradients of their own dtype, and each step's loss matches plain `backend="inductor"`
under the same Trainer. Lightning's logger, checkpointing and progress bar are off; no global seeding: the module
seeds its own init and the batches come from their own generator.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import moepass
from helpers import TINY
from moepass.models import build_model

pl = pytest.importorskip("pytorch_lightning")

pytestmark = [
    # Lightning's notices about its own pytree use and the dataloader's worker count; layer norms under autocast
    pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*Mismatch dtype between input and weight:UserWarning"),
]

# two steps: the second runs the compiled step again, on the weights the first optimizer step updated; a third
# repeats that
STEPS, BATCH, SEQ = 2, 2, 32
# measured over the 2 steps, relative: loss gaps <= 1.1e-4 and grad-norm gaps <= 3e-5 (MXFP8 emulated vs Inductor's
# BF16, and vs the uncompiled module). A dropped optimizer update moves the second loss by only 6e-4 (lr=0 measured):
# these tolerances do not catch that, the losses differ ~2% across steps by batch
LOSS_RTOL = GRAD_NORM_RTOL = 2e-3
# the debug model at TINY sizes cut to one layer, a MoE layer: the dense layer's FFN is the shared expert's class, and
# each Inductor-CPU compile costs about a second per distinct kernel (the compiled-module pair: 76 kernels at two
# layers, 54 at one). Linears: attention wq, wkv_a, wkv_b, wo + the shared expert's 3; grouped: the routed experts'
# w1, w3, w2; kept BF16: the router gate and the output head
MOE_LAYER = {**TINY, "n_layers": 1, "n_dense_layers": 0}
GROUPED, LINEARS, KEPT_BF16 = 3, 7, {"OUTPUT_HEAD": 1, "ROUTER_GATE": 1}


class TinyDeepSeek(pl.LightningModule):
    """Next-token loss of the one-layer debug DeepSeek-V3, built in FP32 (as Lightning users keep weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = build_model("debug", **MOE_LAYER, dtype=torch.float32)

    def training_step(self, ids, batch_idx):
        logits = self.model(ids[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepLog(pl.Callback):
    """Each step's loss, gradient norm and the dtypes the gradients arrived in."""

    def __init__(self):
        self.losses, self.grad_norms, self.grad_dtypes = [], [], set()

    def on_before_optimizer_step(self, trainer, module, optimizer):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        self.grad_norms.append(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads])).item())
        self.grad_dtypes |= {(p.dtype, p.grad.dtype) for p in module.parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def token_batches() -> torch.utils.data.DataLoader:
    ids = torch.randint(0, TINY["vocab_size"], (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(ids, batch_size=BATCH)


def fit(precision: str, compile_module=None, compile_inner=None):
    """STEPS of Trainer.fit; compile_module / compile_inner: how the LightningModule or its inner model is compiled.
    (StepLog, moepass's report of the run, the module)."""
    torch._dynamo.reset()
    module, log = TinyDeepSeek(), StepLog()
    if compile_inner is not None:
        module.model = compile_inner(module.model)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[log])
    with moepass.collecting() as report:
        trainer.fit(module if compile_module is None else compile_module(module), token_batches())
    return log, report, module


def assert_rewritten(report) -> None:
    """One graph, the routed experts' grouped GEMMs and the linears rewritten, the rest kept BF16 with its code."""
    d, cov = report.to_dict(), report.coverage()
    assert (d["graphs"], report.graph_breaks) == (1, 0)
    replaced = {p["name"]: p["replaced"] for p in d["passes"]}
    assert (replaced["grouped_mm"], replaced["linear"]) == (GROUPED, LINEARS), replaced
    assert (cov["low_precision"], cov["bf16"], cov["unaccounted"]) == (GROUPED + LINEARS, KEPT_BF16, 0), cov


def assert_trained_like(log: StepLog, reference: StepLog) -> None:
    assert len(log.losses) == len(log.grad_norms) == STEPS
    assert all(map(math.isfinite, log.losses + log.grad_norms))
    assert log.losses == pytest.approx(reference.losses, rel=LOSS_RTOL)
    assert log.grad_norms == pytest.approx(reference.grad_norms, rel=GRAD_NORM_RTOL)


def by_backend(backend: str, **kwargs):
    return lambda module: torch.compile(module, backend=backend, **kwargs)


@pytest.mark.parametrize("precision, weights", [
    pytest.param("bf16-mixed", torch.float32, id="bf16-mixed"),
    pytest.param("bf16-true", torch.bfloat16, id="bf16-true", marks=pytest.mark.extended),  # another Inductor pair
])
def test_compiled_module_matches_plain_inductor(precision, weights):
    """Lightning's idiom, trainer.fit(torch.compile(module, backend=...)), with moepass and with plain Inductor."""
    inductor_log, inductor_report, _ = fit(precision, compile_module=by_backend("inductor"))
    assert inductor_report.to_dict()["graphs"] == 0  # moepass saw nothing

    log, report, module = fit(precision, compile_module=by_backend("moepass"))

    assert module._compiler_ctx is not None  # Lightning unwrapped the compiled module and compiled its steps
    assert_rewritten(report)
    assert {p.dtype for p in module.parameters()} == {weights}
    assert log.grad_dtypes == {(weights, weights)}  # bf16-mixed: FP32 masters get FP32 gradients
    assert_trained_like(log, inductor_log)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_inner_model_compiled_before_fit(precision):
    """The other way: the LightningModule's inner model compiled before fit (Inductor off to keep CI fast: the passes
    rewrite the same graph). Losses within the recipe's noise of the same Trainer uncompiled."""
    eager_log, _, _ = fit(precision)
    log, report, module = fit(precision, compile_inner=by_backend("moepass", options={"inductor": False}))
    assert_rewritten(report)
    assert isinstance(module.model, torch._dynamo.eval_frame.OptimizedModule)
    weights = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert log.grad_dtypes == {(weights, weights)}
    assert_trained_like(log, eager_log)
