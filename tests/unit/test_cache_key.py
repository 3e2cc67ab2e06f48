"""The compile-cache key hashes the code and the data that can shape a compiled graph, and not the benchmark harness."""

import pathlib
import shutil
import tomllib

import pytest
import torch

import moepass
import moepass.harness
import moepass.passes
from moepass import Config, inductor_route
from moepass.inductor_stage import cache_key
from moepass.inductor_stage.cache_key import CompiledGraphAudit, source_files, source_hash, source_roots, tree_hash
from moepass.pipeline import inductor_handoff
from moepass.recipes import measure

MOEPASS = pathlib.Path(moepass.__file__).parent
REPO = MOEPASS.parent


def _hashed_paths() -> set[pathlib.Path]:
    return {path for _, path in source_files(source_roots())}


def test_harness_is_not_hashed():
    harness = sorted(pathlib.Path(moepass.harness.__file__).parent.glob("*.py"))
    assert len(harness) > 5  # bench, converge, plot, ... are really there to leave out
    assert not _hashed_paths() & set(harness)


def test_engine_analysis_recipes_ops_and_passes_are_hashed():
    hashed = _hashed_paths()
    for folder in (MOEPASS / "analysis", MOEPASS / "recipes", MOEPASS / "ops", MOEPASS / "ops" / "lowp",
                   MOEPASS / "ops" / "lowp" / "fp8_rowwise", MOEPASS / "ops" / "ep",
                   pathlib.Path(moepass.passes.__file__).parent):
        files = set(folder.glob("*.py"))
        assert files and files <= hashed, folder
    assert {MOEPASS / "backend.py", MOEPASS / "pipeline.py", MOEPASS / "options.py"} <= hashed


def _tree(root: pathlib.Path) -> pathlib.Path:
    pkg = root / "moepass"
    for rel in ("backend.py", "ops/linear.py", "harness/plot.py", "harness/bench.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(f"# {rel}\n")
    return pkg


def test_editing_the_harness_keeps_the_key_editing_an_op_changes_it(tmp_path):
    pkg = _tree(tmp_path)
    before = tree_hash([pkg])
    (pkg / "harness" / "plot.py").write_text("# a new chart colour\n")
    (pkg / "harness" / "timing.py").write_text("# a new harness file\n")
    assert tree_hash([pkg]) == before
    (pkg / "ops" / "linear.py").write_text("# a new backward\n")
    assert tree_hash([pkg]) != before


def test_the_audit_pass_uuid_is_the_source_hash():
    assert CompiledGraphAudit().uuid() == f"moepass-{source_hash()}"


# ---- data files: the shipped tables are in both entry points' keys

def _package_data() -> list[pathlib.Path]:
    """Every file pyproject.toml's package-data ships, found where its package sits in the repository."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]

    def folder(package: str) -> pathlib.Path:  # under the longest package-dir entry holding it
        base = max((p for p in package_dir if package == p or package.startswith(f"{p}.")), key=len)
        return REPO / package_dir[base] / package.removeprefix(base).lstrip(".").replace(".", "/")

    return sorted(path for package, patterns in setuptools["package-data"].items() for pattern in patterns
                  for path in folder(package).glob(pattern))


def test_every_data_file_the_package_ships_is_hashed():
    shipped = _package_data()
    assert {MOEPASS / "recipes" / "fp8_auto_table_h100.json", MOEPASS / "recipes" / "fp8_auto_table_h200.json"} <= \
        set(shipped)
    assert set(shipped) <= _hashed_paths()


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """moepass and its passes copied to tmp_path, and the cache key read from the copy (the real files stay as
    they are)."""
    roots = []
    for real in source_roots():
        roots.append(tmp_path / real.name)
        shutil.copytree(real, roots[-1], ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache_key, "source_roots", lambda: roots)
    yield tmp_path / "moepass"
    source_hash.cache_clear()  # the next key is the real package's again


def _entry_point_keys() -> dict[str, str]:
    """What each entry point puts into Inductor's cache key, read afresh: the backend's audit (its uuid holds the
    settled recipe options), the route's pre-grad pass and its audit."""
    source_hash.cache_clear()
    config = Config.from_options({})
    route_pass = inductor_route.MoepassPreGradPass(config)
    route_audit = inductor_route.RouteAudit(route_pass, inductor_handoff(config, inductor_route.WEIGHTS_SHARDED))
    backend_audit = CompiledGraphAudit(variant=inductor_handoff(config, weights_sharded=False).variant)
    return {"backend": backend_audit.uuid(), "route pre-grad": route_pass.uuid(), "route audit": route_audit.uuid()}


def test_a_table_changes_both_entry_points_keys_and_an_unrelated_file_does_not(package_copy):
    before = _entry_point_keys()
    (package_copy / "harness" / "plot.py").write_text("# a new chart colour\n")
    (package_copy / "recipes" / "NOTES.txt").write_text("how the tables were measured\n")
    assert _entry_point_keys() == before
    table = package_copy / "recipes" / "fp8_auto_table_h100.json"
    table.write_bytes(table.read_bytes().replace(b'"speedup": ', b'"speedup": 0.5 + ', 1))
    after = _entry_point_keys()
    assert all(after[k] != before[k] for k in before), (before, after)


def test_measured_verdicts_join_the_route_key_only_when_its_pass_runs_after_the_cache_lookup(tmp_path, monkeypatch):
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "pre_grad_pass_timing"):
        pytest.skip("torch < 2.12 always runs the pre-grad pass before the cache lookup")
    monkeypatch.setenv(measure.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H800")  # no shipped table
    verdicts = measure.cache_path("NVIDIA H800")
    route_pass = inductor_route.MoepassPreGradPass(Config.from_options({}))

    def keys() -> tuple[str, str]:
        timing = {}
        for when in ("early", "late"):
            # config.patch, not monkeypatch: pytest 9 undoes a config entry with delattr, hiding it from every later
            # compile in the worker ("pre_grad_pass_timing does not exist")
            with inductor_config.patch(pre_grad_pass_timing=when):
                timing[when] = route_pass.uuid()
        return timing["early"], timing["late"]

    early, unmeasured = keys()
    verdicts.parent.mkdir(parents=True)
    verdicts.write_text('{"entries": {"linear K=7168 N=2048 M=8192": {"speedup": 1.2}}}')
    assert keys()[0] == early and keys()[1] != unmeasured
    measured = keys()[1]
    verdicts.write_text('{"entries": {"linear K=7168 N=2048 M=8192": {"speedup": 0.9}}}')
    assert keys() == (early, keys()[1]) and keys()[1] not in (unmeasured, measured)
