"""What moepass rewrites in each precision mode people train in, and how far its losses are from Inductor's.

    python examples/precision_matrix.py --out precision_matrix.json      # every row, CPU (8-15 min on 2 cores)
    python examples/precision_matrix.py --models ours --modes autocast,lightning --quick

Rows: a model (transformers' DeepSeek-V3, Mixtral and Llama4 text at the tiny sizes of
tests/integration/test_hf_families.py, and moepass's own debug DeepSeek-V3 at the tests' sizes) x a precision mode:
    autocast   FP32 master weights, each step's forward and loss under torch.autocast("cpu", dtype=torch.bfloat16)
    fp32       FP32 weights, no autocast
    bf16       the model converted to BF16
    lightning  PyTorch Lightning, precision="bf16-mixed" on FP32 weights, the LightningModule compiled
    trainer    HF Trainer, TrainingArguments(bf16=True) on FP32 weights (moepass.inductor_route, torch_compile=True)
Each row trains STEPS optimizer steps twice on the same weights and batches, once with backend="moepass" and once with
backend="inductor", and shows: weight GEMMs found, rewritten to low precision, kept BF16 (or FP32) by skip code,
unaccounted, and the largest per-step relative loss gap. A row that fails shows its error and the next row runs.
--quick runs moepass's rewritten graph without Inductor (options={"inductor": False}; the trainer row then hands
Trainer a model compiled with backend="moepass"). The recipe is moepass's default (MXFP8, emulated on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

import moepass
import moepass.inductor_route
from moepass.models import build_model

STEPS, BATCH, SEQ, LR = 3, 2, 64, 1e-3
MODES = ("autocast", "fp32", "bf16", "lightning", "trainer")
FP32_WEIGHTS = ("autocast", "fp32", "lightning", "trainer")

# tests/integration/test_hf_families.py's tiny sizes (every MLA GEMM dimension a multiple of 32)
HF_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=4, use_cache=False, attn_implementation="sdpa")
HF_MODELS = {
    "hf-deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                       dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                            first_k_dense_replace=1, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
                            qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16)),
    "hf-mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16)),
    "hf-llama4-text": ("Llama4TextConfig", "Llama4ForCausalLM",
                       dict(intermediate_size_mlp=64, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                            attention_chunk_size=64)),
}
# tests/fixtures/helpers.py's TINY: layer 0 dense, layer 1 MoE
OURS_TINY = dict(n_layers=2, dim=128, inter_dim=256, moe_inter_dim=64, n_heads=2, kv_lora_rank=64, vocab_size=512)
MODELS = (*HF_MODELS, "ours")


class NextTokenLoss(torch.nn.Module):
    """moepass's DeepSeek-V3 behind the interface transformers' models have: forward(input_ids, labels) -> {"loss"}."""

    accepts_loss_kwargs = False  # Trainer: pass no num_items_in_batch (it reads the compiled wrapper's **kwargs)

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.model = build_model("debug", **OURS_TINY, dtype=dtype)

    def forward(self, input_ids, labels):
        logits = self.model(input_ids[:, :-1])
        return {"loss": F.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten())}


def build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "ours":
        return NextTokenLoss(dtype)
    import transformers

    config_class, model_class, overrides = HF_MODELS[name]
    config = getattr(transformers, config_class)(**{**HF_TINY, **overrides})
    return getattr(transformers, model_class)(config).to(dtype)


def batches(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def vocab_size(model) -> int:
    return (model.model if isinstance(model, NextTokenLoss) else model).config.vocab_size


# ---------------------------------------------------------------- one training run per mode: (losses, report)


def _compile(model, backend: str, quick: bool):
    options = {"options": {"inductor": False}} if backend == "moepass" and quick else {}
    return torch.compile(model, backend=backend, **options)


def plain_loop(name: str, mode: str, backend: str, quick: bool) -> list[float]:
    model = build(name, torch.bfloat16 if mode == "bf16" else torch.float32)
    compiled = _compile(model, backend, quick)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    losses = []
    for ids in batches(vocab_size(model)):
        with region:
            loss = compiled(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def lightning(name: str, mode: str, backend: str, quick: bool) -> list[float]:
    import pytorch_lightning as pl

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)  # Lightning sets INFO when imported
    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build(name, torch.float32)

        def training_step(self, ids, batch_idx):
            return self.model(input_ids=ids, labels=ids)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(outputs["loss"].item())

    module, log = Module(), Losses()
    data = torch.utils.data.DataLoader(batches(vocab_size(module.model)).flatten(0, 1), batch_size=BATCH)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[log])
    trainer.fit(_compile(module, backend, quick), data)
    return log.losses


def hf_trainer(name: str, mode: str, backend: str, quick: bool) -> list[float]:
    import transformers

    model = build(name, torch.float32)
    rows = batches(vocab_size(model)).flatten(0, 1)
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    route = backend == "moepass" and not quick  # the documented line: moepass inside accelerate's Inductor compile
    precompiled = backend == "moepass" and quick
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, bf16=True, torch_compile=not precompiled, max_steps=STEPS, per_device_train_batch_size=BATCH,
            learning_rate=LR, logging_steps=1, seed=0, use_cpu=True, report_to=[], save_strategy="no",
            disable_tqdm=True, remove_unused_columns=not precompiled)  # a compiled forward names no column
        trainer = transformers.Trainer(model=_compile(model, backend, quick) if precompiled else model, args=args,
                                       train_dataset=dataset)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # its log lines would bury the table
        with moepass.inductor_route.route() if route else contextlib.nullcontext():
            trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


RUNS = {"autocast": plain_loop, "fp32": plain_loop, "bf16": plain_loop, "lightning": lightning, "trainer": hf_trainer}


# ---------------------------------------------------------------- one row


def _error(e: Exception) -> str:
    text = str(e)
    # Dynamo's first line is generic ("RuntimeError when making fake tensor call"): what the op raised follows "got"
    raised = re.search(r"got (\w+(?:Error|Exception)\(.*?\))(?:\s|$)", text)
    said = raised.group(1) if raised else next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {said}"[:300]


def _losses(name: str, mode: str, backend: str, quick: bool, out: dict) -> list[float] | None:
    """One run; its failure is written into the row (`<backend>_error`, `<backend>_traceback`), never raised."""
    torch._dynamo.reset()
    try:
        return RUNS[mode](name, mode, backend, quick)
    except Exception as e:  # a row's failure is its result; the next row runs
        out[f"{backend}_error"], out[f"{backend}_traceback"] = _error(e), traceback.format_exc()
        return None


def row(name: str, mode: str, quick: bool) -> dict:
    """Both runs of one (model, mode): moepass's report of its run and the loss gap to Inductor's."""
    out = {"model": name, "mode": mode}
    started = time.perf_counter()
    reference = _losses(name, mode, "inductor", quick, out)
    with moepass.collecting() as report:
        losses = _losses(name, mode, "moepass", quick, out)
    if report.to_dict()["graphs"]:  # what the passes did, even where the step failed after them
        cov = report.coverage()
        out.update(graphs=report.to_dict()["graphs"], graph_breaks=report.graph_breaks, gemms=cov["gemms"],
                   rewritten=cov["low_precision"], kept=cov["bf16"], unaccounted=cov["unaccounted"])
    out.update(losses=losses, inductor_losses=reference, loss_gap=None)
    if losses and reference and len(losses) == len(reference) == STEPS and all(map(math.isfinite, losses)):
        out["loss_gap"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | mode | GEMMs | rewritten | kept (code: count) | unaccounted | loss gap to Inductor | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        said = {b: r[f"{b}_error"] for b in ("moepass", "inductor") if f"{b}_error" in r}
        errors = (f"both: {said['moepass']}" if len(set(said.values())) == 1 < len(said) else
                  "; ".join(f"{b}: {e}" for b, e in said.items()))
        gap = f"{r['loss_gap']:.1e}" if r["loss_gap"] is not None else f"n/a ({errors.replace('|', '/')})"
        if "gemms" not in r:
            lines.append(f"| {r['model']} | {r['mode']} | - | - | - | - | {gap} | {r['seconds']} |")
            continue
        kept = ", ".join(f"{code} {n}" for code, n in r["kept"].items()) or "-"
        graphs = "" if (r["graphs"], r["graph_breaks"]) == (1, 0) else \
            f" ({r['graphs']} graphs, {r['graph_breaks']} breaks)"
        lines.append(f"| {r['model']} | {r['mode']} | {r['gemms']}{graphs} | {r['rewritten']} | {kept} | "
                     f"{r['unaccounted']} | {gap} | {r['seconds']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--quick", action="store_true", help="moepass without Inductor (the same rewrites, run eagerly)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    models, modes = args.models.split(","), args.modes.split(",")
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"unknown {unknown}: models are {MODELS}, modes {MODES}")
    warnings.filterwarnings("ignore")  # the libraries' notices would bury the table
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # a failing row says it in the row
    rows = []
    for name in models:
        for mode in modes:
            rows.append(row(name, mode, args.quick))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"steps": STEPS, "batch": BATCH, "seq": SEQ, "quick": args.quick, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
