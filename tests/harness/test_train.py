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
