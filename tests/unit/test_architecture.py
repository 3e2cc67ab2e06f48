"""The layout docs/architecture.md describes, kept true: the folders stack in LAYERS' order (each imports only the
layers below its own), no import cycles inside moepass, one pipeline list, every package folder installed.

`python tests/unit/test_architecture.py` prints the page's layer table (who reads whom) from LAYERS and the imports.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import tomllib

import networkx as nx

import moepass
from moepass import options, pipeline

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"moepass": REPO / "moepass", "moepass.passes": REPO / "passes", "moepass.models": REPO / "models"}

# Bottom to top: a folder ("x/") or module of a layer imports only from the layers below it, or from itself; the
# folders and modules of one layer never import each other. A module belongs to the longest folder or module listed
# that holds it. Runtime imports count, function-local ones too; those under `if TYPE_CHECKING:` do not. A package's
# __init__.py may also import its own sub-folders (moepass/ops/__init__.py registers ops/ep/ and ops/lowp/).
LAYERS = (
    ("leaves", ("models/", "moepass/option_types.py", "moepass/skips.py", "moepass/op_registry.py",
                "moepass/device_arch.py", "moepass/torchao_import.py", "moepass/dynamo_flags.py")),
    ("analysis", ("moepass/analysis/",)),
    ("recipes", ("moepass/recipes/",)),
    ("ops", ("moepass/ops/",)),
    ("op kinds", ("moepass/ops/ep/", "moepass/ops/lowp/")),
    ("options", ("moepass/options.py",)),
    ("report", ("moepass/report/",)),
    ("passes", ("passes/",)),
    ("inductor stage", ("moepass/inductor_stage/",)),
    ("pipeline", ("moepass/pipeline.py",)),
    ("entry points", ("moepass/backend.py", "moepass/inductor_route.py", "moepass/inspect.py", "moepass/harness/")),
    ("front doors", ("moepass/__init__.py", "moepass/cli.py", "moepass/torchtitan.py")),
)
LAYER = {room: i for i, (_, rooms) in enumerate(LAYERS) for room in rooms}


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


def _type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def module_imports(source: str, name: str, is_package: bool, modules) -> set[str]:
    """The modules (among `modules`) that module `name` imports at run time: every import statement, function-local
    ones too, but those under `if TYPE_CHECKING:`. `from p import x` is an edge to p.x when x is a module, else to
    p; importing a submodule is not counted as importing its parents."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            children = node.orelse  # the `if TYPE_CHECKING:` body never runs
        else:
            children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        for child in children:
            visit(child)

    visit(ast.parse(source))
    return {t for t in found if t in modules and t != name}


def import_graph() -> nx.DiGraph:
    """module -> module it imports at run time (module_imports), over the whole installed package."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        imports = module_imports(path.read_text(), name, path.name == "__init__.py", modules)
        graph.add_edges_from((name, t) for t in imports)
    return graph


def _where(module: str, modules: dict[str, pathlib.Path]) -> str:
    """A module's file, relative to the repository (passes/ and models/ where they are, not where they install)."""
    return modules[module].relative_to(REPO).as_posix()


def room_of(path: str) -> str | None:
    """The folder or module of LAYERS that holds `path` (relative to the repository): the longest that does."""
    holders = [room for room in LAYER if path == room or room.endswith("/") and path.startswith(room)]
    return max(holders, key=len, default=None)


def _own_subfolder(path: str, imported: str) -> bool:
    """`path` is a package's __init__.py and `imported` lies in that package's folder."""
    folder = path.removesuffix("__init__.py")
    return path.endswith("/__init__.py") and imported.startswith(folder)


def layer_violations(graph: nx.DiGraph) -> list[str]:
    """Every import that does not go down LAYERS (or stay in its own folder or module), named."""
    modules = _modules()
    wrong = []
    for a, b in sorted(graph.edges):
        path_a, path_b = _where(a, modules), _where(b, modules)
        room_a, room_b = room_of(path_a), room_of(path_b)
        if room_a is None or room_b is None or room_a == room_b or LAYER[room_b] < LAYER[room_a] \
                or _own_subfolder(path_a, path_b):
            continue  # a module in no layer fails test_every_module_has_a_layer
        (up_a, _), (up_b, _) = LAYERS[LAYER[room_a]], LAYERS[LAYER[room_b]]
        wrong.append(f"{path_a} imports {path_b}: {room_a} (layer {LAYER[room_a]}, {up_a}) may import only layers "
                     f"below it, and {room_b} is layer {LAYER[room_b]} ({up_b})")
    return wrong


def reads_table(graph: nx.DiGraph) -> str:
    """docs/architecture.md's layer table, top to bottom: each layer's folders and modules (those that read the same
    share a row) and what they read, named under moepass/ (passes/ and models/ where they are)."""
    modules = _modules()
    reads = {room: set() for room in LAYER}
    for a, b in graph.edges:
        room_a, room_b = room_of(_where(a, modules)), room_of(_where(b, modules))
        if None not in (room_a, room_b) and room_a != room_b:  # a module in no layer fails its own test
            reads[room_a].add(room_b)
    rows = ["| layer | folder or module | reads (measured) |", "|---|---|---|"]
    for i, (name, rooms) in reversed(list(enumerate(LAYERS))):
        alike = {}  # what they read -> the rooms that read it, in LAYERS' order
        for room in rooms:
            alike.setdefault(frozenset(reads[room]), []).append(room)
        for read, readers in alike.items():
            shown = [f"`{r.removeprefix('moepass/')}`" + (" (own sub-folder)" if LAYER[r] >= i else "")
                     for r in sorted(read, key=lambda r: (-LAYER[r], r))]
            rooms_shown = ", ".join(f"`{r}`" for r in readers)
            rows.append(f"| {i} {name} | {rooms_shown} | {', '.join(shown) or 'nothing from moepass'} |")
    return "\n".join(rows)


def _page_table() -> str:
    lines = (REPO / "docs" / "architecture.md").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if "<!-- layers-table" in line), len(lines))
    return "\n".join(itertools.takewhile(lambda line: line.startswith("|"), lines[start + 1:]))


def homeless(graph: nx.DiGraph, modules: dict[str, pathlib.Path]) -> list[str]:
    """Every module in no layer, with the lowest layer it could join (the one above everything it imports)."""
    found = []
    for name in sorted(modules):
        path = _where(name, modules)
        if room_of(path) is None:
            below = [LAYER[r] for r in (room_of(_where(b, modules)) for b in graph.successors(name)) if r]
            lowest = min(max(below, default=-1) + 1, len(LAYERS) - 1)
            found.append(f"{path} is in no layer: list it (or its folder) in LAYERS, tests/unit/test_architecture.py, "
                         f"in layer {lowest} ({LAYERS[lowest][0]}) or higher, the lowest above all it imports")
    return found


def test_every_module_has_a_layer():
    listed = [room for _, rooms in LAYERS for room in rooms]
    assert len(listed) == len(set(listed)), "a folder or module listed in two layers"
    stale = [room for room in listed if not (REPO / room).exists()]
    assert not stale, f"LAYERS lists what does not exist: {stale}"
    wrong = homeless(import_graph(), _modules())
    assert not wrong, "\n".join(wrong)


def test_a_module_in_no_layer_is_told_where_to_go():
    modules, graph = _modules(), import_graph()
    modules["moepass.stage"] = REPO / "moepass" / "stage.py"  # planted: a new top-level module reading recipes/
    graph.add_edge("moepass.stage", "moepass.recipes.plan")
    assert homeless(graph, modules) == [
        "moepass/stage.py is in no layer: list it (or its folder) in LAYERS, tests/unit/test_architecture.py, in "
        "layer 3 (ops) or higher, the lowest above all it imports"]


def test_the_folders_stack():
    wrong = layer_violations(import_graph())
    assert not wrong, "imports that run up LAYERS:\n" + "\n".join(wrong)


def test_an_upward_import_fails_the_check_naming_it():
    graph = import_graph()
    assert not layer_violations(graph)
    graph.add_edge("moepass.analysis.graph", "moepass.report.records")  # planted: analysis reading report
    assert layer_violations(graph) == [
        "moepass/analysis/graph.py imports moepass/report/records.py: moepass/analysis/ (layer 1, analysis) may import "
        "only layers below it, and moepass/report/ is layer 6 (report)"]
    graph.add_edge("moepass.ops.ep.permute", "moepass.ops.lowp.formats")  # planted: one op kind reading the other
    assert any(v.startswith("moepass/ops/ep/permute.py imports moepass/ops/lowp/formats.py") for v in
               layer_violations(graph))


def test_imports_under_type_checking_do_not_count_and_function_local_ones_do():
    modules = {"moepass", "moepass.analysis", "moepass.analysis.graph", "moepass.options", "moepass.report",
               "moepass.report.records", "moepass.skips"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import typing\n"
        "from ..skips import Reason\n"
        "if TYPE_CHECKING:\n"
        "    from moepass.options import Config\n"
        "if typing.TYPE_CHECKING:\n"
        "    import moepass.options\n"
        "else:\n"
        "    from . import graph\n"
        "def f():\n"
        "    from moepass.report import records\n"
    )
    assert module_imports(source, "moepass.analysis.rules", False, modules) == {
        "moepass.skips", "moepass.analysis.graph", "moepass.report.records"}


def test_the_architecture_page_shows_the_layers_as_measured():
    assert _page_table() == reads_table(import_graph()), (
        "docs/architecture.md's layer table is stale: replace it (the lines after its `layers-table` marker) with the "
        "output of `python tests/unit/test_architecture.py`")


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
    another recipe's folder; its recipe.py registers the recipe, and nothing else in moepass.ops imports the
    registry. Nothing else in moepass.ops imports a recipe folder, but lowp/__init__, which imports every folder so
    that `import moepass.ops` registers every op and every built-in recipe."""
    graph = import_graph()
    folders = {p.parent.name for p in (REPO / "moepass" / "ops" / "lowp").glob("*/recipe.py")}
    assert {"mxfp8", "fp8_rowwise", "blockwise"} <= folders

    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[3] if parts[:3] == ["moepass", "ops", "lowp"] and len(parts) > 3 and parts[3] in folders else None

    wrong = sorted((a, b) for a, b in graph.edges if a.startswith("moepass.ops") and (
        (b == "moepass.recipes.registry" and a != f"moepass.ops.lowp.{folder(a)}.recipe") or
        (folder(b) not in (None, folder(a)) and a != "moepass.ops.lowp")))
    assert not wrong, wrong
    registering = {a for a, b in graph.edges if b == "moepass.recipes.registry" and a.startswith("moepass.ops")}
    assert registering == {f"moepass.ops.lowp.{name}.recipe" for name in folders}


def test_the_pass_order_is_written_once_and_every_pass_module_runs():
    """options.PIPELINE is the order; pipeline.PASSES is read off it (moepass.passes.<name>), and every pass module
    is one of its names."""
    pass_modules = {f"moepass.passes.{name}" for name in options.PIPELINE}
    assert not set(import_graph().successors("moepass.pipeline")) & pass_modules, \
        "pipeline.py imports passes by name, writing the order again: read it off options.PIPELINE"
    assert {name: module.NAME for name, module in pipeline.PASSES.items()} == {n: n for n in options.PIPELINE}
    assert [module.__name__ for module in pipeline.PASSES.values()] == [f"moepass.passes.{n}" for n in options.PIPELINE]
    passes = {p.stem for p in PACKAGE_DIRS["moepass.passes"].glob("*.py") if p.stem != "__init__"}
    assert set(options.PIPELINE) == passes, "a pass module the pipeline does not run, or the reverse"
    assert {slot for slot, _ in pipeline.INDUCTOR_STAGE} == set(options.MOEPASS_INDUCTOR_PATCHES)


def test_every_package_folder_is_installed():
    """pyproject.toml lists packages by hand (passes/ and models/ install under moepass.*): a new folder must be
    listed there, or an installed moepass lacks it."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders == listed, f"missing from pyproject.toml: {sorted(folders - listed)}; stale: {sorted(listed - folders)}"
    assert pathlib.Path(moepass.__file__).parent == PACKAGE_DIRS["moepass"]


if __name__ == "__main__":
    print(reads_table(import_graph()))
