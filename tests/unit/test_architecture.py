"""The layout docs/architecture.md describes, kept true: no import cycles inside moepass, one pipeline list, every
package folder installed."""

from __future__ import annotations

import ast
import pathlib
import tomllib

import networkx as nx

import moepass
from moepass import options, pipeline

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"moepass": REPO / "moepass", "moepass.passes": REPO / "passes", "moepass.models": REPO / "models"}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, by dotted name (passes/ and models/ under their installed names)."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def import_graph() -> nx.DiGraph:
    """module -> module it imports, from every import statement (function-local ones too). `from p import x` is an
    edge to p.x when x is a module, else to p; importing a submodule is not counted as importing its parents."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_moepass_has_no_import_cycles():
    graph = import_graph()
    assert graph.number_of_nodes() > 100 and graph.number_of_edges() > 200  # the scan found the package
    cycles = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


def test_models_import_nothing_from_moepass():
    graph = import_graph()
    wrong = sorted((a, b) for a, b in graph.edges if a.startswith("moepass.models") and
                   not b.startswith("moepass.models"))
    assert not wrong, wrong


def test_a_recipe_folder_stands_alone_and_the_op_families_name_no_recipe():
    """A recipe is one folder, moepass/ops/lowp/<name>/ (its recipe.py): it may import the shared op families, never
    another recipe's folder or the registry. Nothing else in moepass.ops imports a recipe folder or the registry, but
    lowp/__init__, which imports every folder so that `import moepass.ops` registers every op."""
    graph = import_graph()
    folders = {p.parent.name for p in (REPO / "moepass" / "ops" / "lowp").glob("*/recipe.py")}
    assert {"mxfp8", "fp8_rowwise", "blockwise"} <= folders

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[3] if parts[:3] == ["moepass", "ops", "lowp"] and len(parts) > 3 and parts[3] in folders else None

    wrong = sorted((a, b) for a, b in graph.edges if a.startswith("moepass.ops") and (
        b == "moepass.recipes.registry" or (folder(b) not in (None, folder(a)) and a != "moepass.ops.lowp")))
    assert not wrong, wrong


def test_the_pipeline_names_every_pass_in_the_options_order():
    assert tuple(pipeline.PASSES) == options.PIPELINE
    passes = {p.stem for p in PACKAGE_DIRS["moepass.passes"].glob("*.py") if p.stem != "__init__"}
    assert set(pipeline.PASSES) == passes, "a pass module the pipeline does not run, or the reverse"
    assert {slot for slot, _ in pipeline.INDUCTOR_STAGE} == set(options.MOEPASS_INDUCTOR_PATCHES)


def test_every_package_folder_is_installed():
    """pyproject.toml lists packages by hand (passes/ and models/ install under moepass.*): a new folder must be
    listed there, or an installed moepass lacks it."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders == listed, f"missing from pyproject.toml: {sorted(folders - listed)}; stale: {sorted(listed - folders)}"
    assert pathlib.Path(moepass.__file__).parent == PACKAGE_DIRS["moepass"]
