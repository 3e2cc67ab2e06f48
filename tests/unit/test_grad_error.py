"""examples/grad_error.py: one step's gradients per parameter group against BF16 Inductor's."""

import importlib.util
import json
import math
import os

import pytest
import torch

from helpers import TINY

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script():
    spec = importlib.util.spec_from_file_location("grad_error", os.path.join(REPO, "examples", "grad_error.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parameter_groups_follow_the_module_paths():
    g = _script().group_of
    assert g("layers.1.moe.experts.w1") == "routed experts"
    assert g("layers.1.moe.shared_experts.w2.weight") == "shared experts"
    assert g("layers.1.moe.router.gate.weight") == "router"
    assert g("layers.0.feed_forward.w3.weight") == "dense FFN"
    assert g("layers.0.attention.wkv_b.weight") == "attention"
    assert g("tok_embeddings.weight") == g("output.weight") == g("layers.0.ffn_norm.weight") == _script().OTHER


def test_sqnr_is_signal_over_the_difference():
    sqnr = _script().sqnr_db
    ref = [torch.ones(4), torch.zeros(2)]
    assert sqnr(ref, ref) == math.inf
    assert sqnr(ref, [torch.full((4,), 1.1), torch.zeros(2)]) == pytest.approx(20.0)  # noise 0.1 on signal 1
    with pytest.raises(RuntimeError, match="different parameters"):
        _script().compare({"a": torch.ones(1)}, {"b": torch.ones(1)})


def test_a_bad_extra_variant_is_named_before_any_compile():
    with pytest.raises(SystemExit, match="must be LABEL=JSON-object"):
        _script().main(["--variant", "mine=recipe=mxfp8"])
    with pytest.raises(SystemExit, match="recipe"):  # a bad option value, before the first variant compiles
        _script().main(["--variant", 'mine={"recipe": "fp9"}'])


@pytest.mark.extended  # three compiles, ~15 s alone on 2 cores (CI is at its time budget): pytest -m extended
def test_the_tiny_model_against_its_nudge_and_mxfp8(tmp_path):
    """End to end on CPU: the nudge and emulated MXFP8 both move the gradients (finite SQNR), every group reported."""
    out = tmp_path / "grad_error.json"
    result = _script().main(["--model-overrides", json.dumps(TINY), "--batch", "1", "--seq", "32",
                             "--variants", "inductor-nudged,mxfp8_experts_only", "--out", str(out),
                             "--variant", 'mine={"recipe": "fp8_rowwise", "lowp.include": ["*.attention.*"]}'])
    assert json.loads(out.read_text())["variants"].keys() == {"inductor", "inductor-nudged", "mxfp8_experts_only",
                                                              "mine"}
    assert result["variants"]["mine"]["options"]["recipe"] == "fp8_rowwise"
    for name in ("inductor-nudged", "mxfp8_experts_only", "mine"):
        sqnr = result["variants"][name]["grad_sqnr_db"]
        assert {"routed experts", "attention", "all"} <= set(sqnr)
        assert all(0 < db < math.inf for db in sqnr.values()), (name, sqnr)
    assert result["variants"]["mxfp8_experts_only"]["options"]["lowp.include"] == ["*.moe.experts"]
