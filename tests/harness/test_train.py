"""moepass/harness/train.py: the training step's learning-rate warm-up."""

import pytest
import torch

from moepass.harness.train import train


def test_lr_warmup_ramps_linearly_then_holds():
    model = torch.nn.Embedding(8, 8)  # tokens [B, S] -> logits [B, S, 8]
    opt = torch.optim.AdamW(model.parameters(), lr=0.4)
    seen = []
    batches = [(torch.randint(0, 8, (2, 4)), torch.randint(0, 8, (2, 4)))] * 6
    train(model, model, batches, 6, torch.device("cpu"), optimizer=opt, lr_warmup=4,
          on_step=lambda r: seen.append(opt.param_groups[0]["lr"]))
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])


def test_adamw_is_fused_on_cuda_as_torchtitan_runs_it_and_torchs_default_elsewhere():
    from moepass.harness.train import adamw, optimizer_name

    params = [torch.nn.Parameter(torch.randn(4, 4))]
    assert adamw(params, 1e-3, torch.device("cuda")).defaults["fused"] is True  # built only: CPU tensors here
    assert not adamw(params, 1e-3, torch.device("cpu")).defaults["fused"]
    assert optimizer_name(torch.device("cuda")) == "AdamW (fused)"
