"""examples/saved_activations.py: the bytes a forward keeps for its backward, parameters excluded."""

import torch
from helpers import load_example


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
    assert measured == {"total": 5 * 8 * 4 + 5 * 32 * 4, "by_dtype": {"float32": 5 * 8 * 4 + 5 * 32 * 4}}
    measured = _script().saved_bytes(Block().to(torch.bfloat16), x.detach().to(torch.bfloat16).requires_grad_())
    assert measured["by_dtype"] == {"bfloat16": (5 * 8 + 5 * 32) * 2}
