"""The compile-cache key hashes the code that can shape a compiled graph, and not the benchmark harness."""

import pathlib

import moepass
import moepass.harness
import moepass.passes
from moepass.inductor_stage.cache_key import CompiledGraphAudit, source_files, source_hash, source_roots, tree_hash

MOEPASS = pathlib.Path(moepass.__file__).parent


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
