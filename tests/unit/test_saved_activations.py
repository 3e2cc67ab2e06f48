"""examples/saved_activations.py: the bytes a forward keeps for its backward, parameters excluded."""

import json

import torch
from helpers import TINY, load_example


def _script():
    return load_example("saved_activations")


class Block(torch.nn.Module):
    """x -> relu(up(x)) -> down: saves x (up's wgrad), relu's output (down's wgrad and relu's backward, one
    storage), no parameter."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 32, bias=False), torch.nn.Linear(32, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_counts_each_saved_storage_once_and_no_parameter():
    x = torch.randn(5, 8, requires_grad=True)
    measured = _script().saved_bytes(Block(), x)
    assert measured["total"] == 5 * 8 * 4 + 5 * 32 * 4 and measured["by_dtype"] == {"float32": measured["total"]}
    assert measured["by_shape"] == [{"shape": [5, 32], "dtype": "float32", "count": 1, "bytes": 5 * 32 * 4},
                                    {"shape": [5, 8], "dtype": "float32", "count": 1, "bytes": 5 * 8 * 4}]
    measured = _script().saved_bytes(Block().to(torch.bfloat16), x.detach().to(torch.bfloat16).requires_grad_())
    assert measured["by_dtype"] == {"bfloat16": (5 * 8 + 5 * 32) * 2}


def test_a_forward_other_than_the_model_is_measured_with_the_models_parameters_left_out():
    block = Block()
    x = torch.randn(5, 8, requires_grad=True)
    measured = _script().saved_bytes(block, x, forward=lambda x: block(x).square().sum())
    assert measured["total"] == 5 * 8 * 4 + 5 * 32 * 4 + 5 * 8 * 4  # and square's input, block's output


def test_the_cli_with_the_loss_compiled_in_keeps_more_than_without(tmp_path):
    script = _script()
    # one (dense) layer: what the loss adds is the logits it keeps, whatever the layers; each layer kind costs compiles
    overrides = json.dumps({**TINY, "n_layers": 1})
    args = ["--flavor", "debug", "--model-overrides", overrides, "--seq", "16", "--variants", "inductor"]
    without = script.main(args)["variants"]["inductor"]
    with_loss = script.main([*args, "--with-loss", "--out", str(tmp_path / "s.json")])["variants"]["inductor"]
    assert with_loss["total"] > without["total"]
    vocab = TINY["vocab_size"]
    assert {"shape": [16, vocab], "dtype": "bfloat16"}.items() <= next(
        r for r in with_loss["by_shape"] if r["shape"] == [16, vocab]).items()  # the logits the loss keeps
