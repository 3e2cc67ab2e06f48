"""Activation checkpointing: the GEMMs inside `tag_activation_checkpoint` bodies are rewritten as at top level.

Every block of the debug model wrapped in `checkpoint_wrapper` (non-reentrant `torch.utils.checkpoint`, what
torchtitan's full AC does) must give the same rewrite counts as the plain model, with module paths in the
state_dict spelling, and the same numbers: eagerly (inductor=False) the checkpointed and plain rewritten
models compute bit for bit the same thing, and under Inductor the backward graph holds the quantized
dgrad/wgrad ops (the recompute runs the quantized forward again, not BF16).
"""

from __future__ import annotations

import pytest
import torch
from helpers import compile_caches_off
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import moepass
from moepass.harness.train import next_token_loss
from moepass.models import build_model

TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


class Checkpointed(nn.Module):
    """A block run under torch.utils.checkpoint by hand (its parameters gain a `.block` path segment)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False)


def _model(checkpointed: str | None):
    torch.manual_seed(0)
    model = build_model("debug", n_layers=3)
    wrap = {"wrapper": checkpoint_wrapper, "function": Checkpointed}.get(checkpointed)
    if wrap is not None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = wrap(layer)
    return model


def _step(model, options):
    torch._dynamo.reset()
    with moepass.collecting() as report, compile_caches_off():
        loss = next_token_loss(torch.compile(model, backend="moepass", options=options)(TOKENS), TOKENS)
        loss.backward()
    grads = {_plain_path(n): p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads, report


def _plain_path(path: str) -> str:
    return path.replace("_checkpoint_wrapped_module.", "").replace(".block.", ".")


def _summary(report) -> dict:
    return {p["name"]: (p["replaced"], sorted(_plain_path(s["module"]) for s in p["skipped"]),
                        sorted(_plain_path(r["module"]) for r in p["rewrites"])) for p in report.to_dict()["passes"]}


@pytest.mark.parametrize("checkpointed", ["wrapper", "function"])
def test_checkpointed_blocks_get_the_same_rewrites_and_numbers(checkpointed):
    options = {"inductor": False}
    plain_loss, plain_grads, plain = _step(_model(None), options)
    loss, grads, report = _step(_model(checkpointed), options)
    assert report.to_dict()["ops_before"]["tag_activation_checkpoint"] == 3
    summary = _summary(report)
    assert summary == _summary(plain)
    assert summary["grouped_mm"][0] == 6 and summary["linear"][0] > 20
    rewrites = [r for p in report.to_dict()["passes"] for r in p["rewrites"]]
    assert all(r["node"].startswith("wrap_body_") for r in rewrites), rewrites[:3]  # inside the AC bodies
    assert "layers.1.moe.router.gate" in summary["linear"][1]
    ops_after = report.to_dict()["ops_after"]
    assert "_grouped_mm" not in ops_after and ops_after["linear"] == plain.to_dict()["ops_after"]["linear"] == 3
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain_grads.keys()
    assert not [n for n in grads if not torch.equal(grads[n], plain_grads[n])]


@pytest.mark.extended  # ~90 s cold: pytest -m extended; the rewrite counts and numerics under AC run in CI
def test_checkpointed_model_under_inductor_recomputes_in_mxfp8():
    loss, grads, report = _step(_model("wrapper"), None)
    plain_loss, _, plain = _step(_model(None), {"inductor": False})
    assert _summary(report) == _summary(plain)
    (backward,) = [c["ops"] for c in report.compiled if c["kind"] == "backward"]
    for op in ("mxfp8_linear", "mxfp8_linear_dgrad", "mxfp8_linear_wgrad", "mxfp8_grouped_mm",
               "mxfp8_grouped_mm_wgrad"):
        assert backward.get(f"moepass.{op}", 0) > 0, (op, backward)  # the recomputed forward is quantized too
    torch.testing.assert_close(loss, plain_loss, rtol=2e-2, atol=2e-2)
    assert all(torch.isfinite(g).all() for g in grads.values())
