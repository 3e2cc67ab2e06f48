"""The low-precision recipes: one folder and one object each (moepass/ops/lowp/<name>/recipe.py), a registry
(moepass/recipes/registry.py), and a planner that names none of them."""

import ast
import dataclasses
import pathlib
import subprocess
import sys

import pytest
import torch

import moepass
import moepass.ops  # noqa: F401  (registers torch.ops.moepass.*)
import moepass.passes
from moepass.option_types import option
from moepass.options import Config, options_table
from moepass.recipes.base import RECIPE_FOLDER, Recipe
from moepass.recipes.plan import GemmPlan, plan_gemm
from moepass.recipes.registry import RECIPES, cache_variant, decomposed_gemms, decompositions, register, settle
from moepass.skips import Reason, SkipCode

MOEPASS = pathlib.Path(moepass.__file__).parent
TOY_RECIPE = pathlib.Path(__file__).parent / "toy_recipe"  # a recipe from outside moepass has the same shape
BUILT_IN = ("mxfp8", "fp8_rowwise", "blockwise")  # the `recipe` option's order: moepass/ops/lowp/__init__.py's
_OPTION = {o.key: o for o in options_table()}


def test_the_recipe_option_offers_auto_and_every_registered_recipe():
    assert _OPTION["recipe"].choices == ("auto", *RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_reads_exactly_the_options_named_after_it(name):
    recipe = RECIPES[name]
    keys = {o.key for o in recipe.options}
    assert recipe.name == name and keys <= set(_OPTION)
    assert {k for k in _OPTION if k.startswith(f"{name}.")} == keys
    assert {recipe.kernel_option, recipe.wgrad_option, *recipe.decomposition_options} <= keys
    assert recipe.read(Config.from_options({})) == recipe.Options()  # its typed options, at their defaults


def test_each_recipe_folder_holds_one_registered_recipe():
    """A recipe is one folder under moepass/ops/lowp/ whose recipe.py registers its ops and its recipe, and
    `import moepass.ops` imports them all (so it registers every op and every built-in recipe)."""
    lowp = MOEPASS / "ops" / "lowp"
    folders = sorted(p.parent.name for p in lowp.glob("*/recipe.py"))
    assert folders == sorted(BUILT_IN)
    for name in BUILT_IN:
        assert type(RECIPES[name]).__module__ == f"moepass.ops.lowp.{name}.recipe"
    imported = {a.name for node in ast.walk(ast.parse((lowp / "__init__.py").read_text()))
                if isinstance(node, ast.ImportFrom) for a in node.names}
    assert set(folders) <= imported


def recipe_folder_problems(folder: pathlib.Path) -> list[str]:
    """What keeps `folder` from the one shape of a recipe folder (RECIPE_FOLDER and __init__.py): a part missing,
    anything else at its top level, a kernels/ that is not a package of modules."""
    want = {"__init__.py", *RECIPE_FOLDER}
    have = {p.name + "/" * p.is_dir() for p in folder.iterdir() if p.name != "__pycache__"}
    problems = [f"{folder.name}/{name} is missing" for name in sorted(want - have)]
    problems += [f"{folder.name}/{name} is no part of a recipe folder ({', '.join(RECIPE_FOLDER)})"
                 for name in sorted(have - want)]
    kernels = folder / "kernels"
    if kernels.is_dir():
        problems += [f"{folder.name}/kernels/{p.name} is not a module" for p in sorted(kernels.iterdir())
                     if p.name != "__pycache__" and p.suffix != ".py"]
        if not (kernels / "__init__.py").is_file():
            problems.append(f"{folder.name}/kernels/ has no __init__.py")
    return problems


@pytest.mark.parametrize("folder", [*sorted(p.parent for p in (MOEPASS / "ops" / "lowp").glob("*/recipe.py")),
                                    TOY_RECIPE], ids=lambda folder: folder.name)
def test_every_recipe_folder_has_the_one_shape(folder):
    assert recipe_folder_problems(folder) == []


def test_a_recipe_folder_off_the_shape_is_told_what_is_off(tmp_path):
    folder = tmp_path / "planted"
    (folder / "kernels" / "tuned").mkdir(parents=True)  # planted: a sub-folder in kernels/, which has no __init__.py
    for name in ("__init__.py", "recipe.py", "linear.py", "grouped_mm.py", "decomp.py", "triton_kernels.py"):
        (folder / name).write_text("")  # planted: no quant.py, a Triton module at the top level
    assert recipe_folder_problems(folder) == [
        "planted/quant.py is missing",
        "planted/triton_kernels.py is no part of a recipe folder (recipe.py, linear.py, grouped_mm.py, quant.py, "
        "kernels/, decomp.py)",
        "planted/kernels/tuned is not a module", "planted/kernels/ has no __init__.py"]


def test_the_recipe_folder_shape_is_written_in_the_docs():
    page = (MOEPASS.parent / "docs" / "recipes.md").read_text()
    section = page.split("## Adding a recipe", 1)[1].split("\n## ", 1)[0]
    assert all(f"| `{name}` |" in section for name in RECIPE_FOLDER) and "RECIPE_FOLDER" in section


def test_any_moepass_import_finds_every_built_in_recipe_registered():
    """The registry imports no recipe (recipes/ sits below ops/): `import moepass` imports moepass.ops, whose
    folders register themselves, so importing only the registry, in a fresh process, finds them in order."""
    code = "from moepass.recipes.registry import RECIPES; print(','.join(RECIPES))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ",".join(BUILT_IN)


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipes_ops_have_its_settings_and_its_alignment(name):
    recipe = RECIPES[name]
    settings = recipe.settings(Config.from_options({}))
    assert len(settings) == len(recipe.op_settings)
    w = torch.zeros(recipe.multiple + 8, recipe.multiple, dtype=torch.bfloat16)  # N not a multiple of the block
    with pytest.raises(ValueError, match=rf"N={recipe.multiple + 8} is not a multiple of {recipe.multiple}"):
        recipe.op("linear")(torch.zeros(4, recipe.multiple, dtype=torch.bfloat16), w, None, *settings, False,
                            "emulated")
    assert recipe.shape_problem(recipe.multiple, 2 * recipe.multiple) is None
    assert recipe.shape_problem(recipe.multiple + 8, recipe.multiple).code is SkipCode.NOT_A_MULTIPLE


def test_decompositions_and_cache_variant_come_from_the_recipes():
    assert cache_variant(Config.from_options({})) == ""  # every option at its default ("auto")
    config = settle(Config.from_options({"fp8_rowwise.linear_both_layouts": "none",
                                         "fp8_rowwise.expert_weights_once": False,
                                         "fp8_rowwise.linear_weights_once": False}), weights_sharded=False)
    table = decompositions(config)
    assert table and all(op.namespace == "moepass" for op in table)
    assert set(table) == {op for r in RECIPES.values() for op in r.decompositions(config)}
    changed = config.with_values(**{"fp8_rowwise.linear_weights_once": True})
    assert "fp8_rowwise.linear_weights_once=True" in cache_variant(changed)
    assert decompositions(changed)[torch.ops.moepass.fp8_rowwise_linear.default] is not \
        table[torch.ops.moepass.fp8_rowwise_linear.default]
    assert decomposed_gemms() == {"_scaled_mm", "_scaled_grouped_mm"}


@dataclasses.dataclass(frozen=True)
class _StubOptions:
    kernel: str = option("fast", "the stub's kernel")
    wgrad_bf16: bool = option(True, "the stub's wgrad")
    block: int = option(4, "the stub's setting")


class _StubRecipe(Recipe):
    """A recipe the planner has never heard of: what it asks, it asks the object."""

    name = "stub"
    Options = _StubOptions
    multiple = 8
    multiple_why = "the stub's block"
    op_settings = ("int block",)

    def choose_kernel(self, requested, device, kind):
        return f"{requested}-{kind}", f"stub kernel on {device}"

    def choose_wgrad_bf16(self, requested, kind):
        return requested, "stub wgrad"

    def settings(self, config):
        return (self.read(config).block,)


def test_the_planner_is_generic_over_the_registry(monkeypatch):
    """A recipe the registry holds (put there directly: the stub has no ops to register) is planned like any."""
    monkeypatch.setitem(RECIPES, "stub", _StubRecipe())
    config = Config.from_options({}).with_values(
        **{"recipe": "stub", "stub.kernel": "fast", "stub.wgrad_bf16": True, "stub.block": 4})
    plan = plan_gemm(config, "grouped", torch.device("cpu"), 64, 16, 24, experts=2)
    assert plan == GemmPlan("stub", "recipe='stub' requested; stub wgrad", "fast-grouped", "stub kernel on cpu",
                            "stub_grouped_mm", (4, True, "fast-grouped"))
    problem = plan_gemm(config, "linear", torch.device("cpu"), 64, 12, 24)
    assert problem == Reason(SkipCode.NOT_A_MULTIPLE, "stub: K=12 not a multiple of 8")


def test_register_refuses_a_recipe_without_its_ops_or_under_a_taken_name():
    with pytest.raises(ValueError, match=r"'stub': ops \['stub_linear', .*\] are not registered"):
        register(_StubRecipe())
    with pytest.raises(ValueError, match="'mxfp8' is already registered"):
        register(RECIPES["mxfp8"])
    assert "stub" not in RECIPES and list(RECIPES) == list(BUILT_IN)


def test_recipe_auto_leaving_a_gemm_in_bf16_is_a_coded_reason(monkeypatch):
    from moepass.recipes import plan

    monkeypatch.setattr(plan, "choose_recipe", lambda *args: ("bf16", "left in BF16: measured slower"))
    reason = plan_gemm(Config.from_options({}), "linear", torch.device("cpu"), 64, 32, 32)
    assert reason == Reason(SkipCode.LEFT_IN_BF16, "left in BF16: measured slower")


def test_the_engine_names_no_recipe():
    """Recipe names appear only in the recipes' own folders, the auto choice (and what it measures), and the CLI's
    examples."""
    allowed = {MOEPASS / "cli.py", MOEPASS / "recipes" / "auto.py", MOEPASS / "recipes" / "measure.py"}
    passes = pathlib.Path(moepass.passes.__file__).parent
    found = []
    for path in [*MOEPASS.rglob("*.py"), *passes.glob("*.py")]:
        if "harness" in path.parts or path in allowed or path.parent.name in RECIPES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in RECIPES:
                found.append(f"{path.relative_to(MOEPASS.parent)}:{node.lineno} {node.value!r}")
    assert found == []



@pytest.mark.parametrize("sharded", [False, True])
def test_auto_layout_options_settle_per_graph(sharded):
    """Both layouts of a linear's operands by default; each weight quantized once unless FSDP2 reshards it (the
    saved FP8 copy would stay alive between forward and backward); nothing both-layout under a BF16 linear wgrad."""
    settled = settle(Config.from_options({}), weights_sharded=sharded)
    assert settled["fp8_rowwise.linear_both_layouts"] == "grads_and_inputs"
    assert settled["fp8_rowwise.expert_weights_once"] is (not sharded)
    assert settled["fp8_rowwise.linear_weights_once"] is (not sharded)
    bf16_wgrad = settle(Config.from_options({"fp8_rowwise.wgrad_bf16": True}), weights_sharded=sharded)
    assert bf16_wgrad["fp8_rowwise.linear_both_layouts"] == "none"
    forced = settle(Config.from_options({"fp8_rowwise.expert_weights_once": True}), weights_sharded=True)
    assert forced["fp8_rowwise.expert_weights_once"] is True  # an explicit choice is kept
    assert cache_variant(settle(Config.from_options({}), weights_sharded=True)) != \
        cache_variant(settle(Config.from_options({}), weights_sharded=False))
