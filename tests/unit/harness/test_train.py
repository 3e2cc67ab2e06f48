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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_step_records_what_its_forward_keeps_for_the_backward():
    """A linear chain keeps its inputs for the weights' gradients: the step reports at least those bytes, and the
    same before every forward (the previous step's activations and gradients are gone by then)."""
    device = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Embedding(64, 256), *[torch.nn.Linear(256, 256) for _ in range(4)],
                                torch.nn.Linear(256, 64)).to(device)
    batches = [(torch.randint(0, 64, (8, 128)), torch.randint(0, 64, (8, 128)))] * 3
    results = train(model, model, batches, 3, device)
    inputs = 5 * 8 * 128 * 256 * 4  # the five linears' fp32 inputs
    for r in results:
        assert r.allocated_after_forward - r.allocated_before_forward >= inputs, r
    assert results[1].allocated_before_forward == results[2].allocated_before_forward
    table = torch.nn.Embedding(8, 8)
    cpu = train(table, table, [(torch.zeros(1, 2, dtype=torch.long),) * 2], 1, torch.device("cpu"))
    assert cpu[0].allocated_before_forward is None and cpu[0].allocated_after_forward is None
