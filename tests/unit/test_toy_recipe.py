"""A recipe from outside moepass (tests/unit/toy_recipe/), registered with one call: the `recipe` option offers it,
`moepass options` lists its keys, and the debug model's GEMMs become its ops and train a step. No moepass file names
it. The fixture takes it back out of the registry, so no other test sees it (its ops stay defined in torch.ops.moepass,
named after it: nothing else calls them)."""

import pathlib

import pytest
import torch

import moepass
import moepass.passes
from moepass.cli import main as moepass_cli
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.options import Config, OptionsError, options_table
from moepass.recipes import registry

from helpers import TINY, compile_caches_off
from toy_recipe import BF16_ROUNDTRIP
from toy_recipe.kernels import reference

NAME = BF16_ROUNDTRIP.name
KEYS = (f"{NAME}.kernel", f"{NAME}.wgrad_bf16", f"{NAME}.accumulate")


@pytest.fixture
def toy_recipe():
    registry.register(BF16_ROUNDTRIP)  # the one call a recipe from outside needs
    yield BF16_ROUNDTRIP
    registry.unregister(NAME)


def _recipe_choices() -> tuple:
    return {o.key: o for o in options_table()}["recipe"].choices


def test_no_moepass_file_names_it():
    sources = [*pathlib.Path(moepass.__file__).parent.rglob("*.py"),
               *pathlib.Path(moepass.passes.__file__).parent.glob("*.py")]
    assert len(sources) > 100 and [p for p in sources if NAME in p.read_text()] == []


def test_registering_it_adds_its_options_and_unregistering_takes_them_back(toy_recipe):
    assert _recipe_choices()[0] == "auto" and _recipe_choices()[-1] == NAME
    config = Config.from_options({"recipe": NAME, f"{NAME}.accumulate": "fp32"})
    assert config.section(NAME) == BF16_ROUNDTRIP.Options(accumulate="fp32")
    with pytest.raises(OptionsError, match=r"'bf16_roundtrip.accumulate'='fp16' is not valid; valid values: \['bf16'"):
        Config.from_options({f"{NAME}.accumulate": "fp16"})
    registry.unregister(NAME)
    try:
        assert NAME not in _recipe_choices() and not set(KEYS) & {o.key for o in options_table()}
        with pytest.raises(OptionsError, match="'recipe'='bf16_roundtrip' is not valid"):
            Config.from_options({"recipe": NAME})
    finally:
        registry.register(BF16_ROUNDTRIP)


def test_moepass_options_lists_its_keys(toy_recipe, capsys):
    assert moepass_cli(["options"]) == 0
    printed = capsys.readouterr().out
    assert all(f"| `{key}` |" in printed for key in KEYS)
    assert f"(auto / mxfp8 / fp8_rowwise / blockwise / {NAME})" in printed  # the `recipe` option's choices


def test_the_debug_model_compiles_to_its_ops_and_trains_a_step(toy_recipe):
    torch.manual_seed(0)
    model = build_model("debug", **TINY)
    tokens = torch.randint(0, TINY["vocab_size"], (2, 32))
    with torch.no_grad():
        eager_loss = next_token_loss(model(tokens), tokens)
    reference.CALLS.clear()
    compiled = torch.compile(model, backend="moepass", options={"recipe": NAME, f"{NAME}.accumulate": "fp32"})
    # the compiled-graph audit runs only when Inductor really compiles (not on a warm cache hit)
    with moepass.collecting() as report, compile_caches_off():
        loss = next_token_loss(compiled(tokens), tokens)
        loss.backward()
    d = report.to_dict()
    passes = {p["name"]: p for p in d["passes"]}
    grouped, linear = passes["grouped_mm"], passes["linear"]
    assert grouped["replaced"] == d["ops_before"]["_grouped_mm"] > 0 and grouped["skipped"] == []
    skipped = {s["module"]: s["reason"] for s in linear["skipped"]}
    assert all("router gate" in r or "output head" in r for r in skipped.values()) and "output" in skipped
    assert linear["replaced"] == d["ops_before"]["linear"] - len(skipped) > 0
    rewrites = grouped["rewrites"] + linear["rewrites"]
    assert {r["op"] for r in rewrites} == {f"moepass.{NAME}_grouped_mm", f"moepass.{NAME}_linear"}
    assert all(f"recipe={NAME} kernel=reference: recipe='{NAME}' requested" in r["detail"] for r in rewrites)
    backward = [c["ops"] for c in report.compiled if c["kind"] == "backward"]
    assert len(backward) == 1 and all(backward[0].get(f"moepass.{NAME}_{gemm}", 0) > 0 for gemm in (
        "linear_dgrad", "linear_wgrad", "grouped_mm_dgrad", "grouped_mm_wgrad"))
    # its own kernels ran, forward and backward, with its option's value as their argument
    assert {gemm for gemm, _, _ in reference.CALLS} == {"linear", "linear_dgrad", "linear_wgrad", "grouped_mm",
                                                         "grouped_mm_dgrad", "grouped_mm_wgrad"}
    assert {(accumulate, kernel) for _, accumulate, kernel in reference.CALLS} == {("fp32", "reference")}
    # plain matmuls: the loss is the model's own, up to BF16 rounding and the passes' reordering
    torch.testing.assert_close(loss.detach(), eager_loss, rtol=2e-2, atol=2e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
