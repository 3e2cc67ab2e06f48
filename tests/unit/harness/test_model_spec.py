"""moepass/harness/model_spec.py: the same seed builds the same weights, for every variant."""

import torch

from helpers import TINY
from moepass.harness.model_spec import ModelSpec


def test_same_seed_same_initial_weights():
    spec = ModelSpec(overrides=TINY)
    a, b = (spec.build(3, torch.device("cpu")).state_dict() for _ in range(2))
    assert all(torch.equal(a[k], b[k]) for k in a)
