"""examples/results/ stays navigable: one index row per entry, links that resolve, commands a reader can rerun.

The index is a Markdown table whose second column names a folder or file in backticks; examples/results/README.md
indexes the folder, archive/README.md the archive. The top-level README's results table must point into them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "examples" / "results"
ARCHIVE = RESULTS / "archive"
CITED = re.compile(r"examples/results/([\w.{},/-]*[\w/])?")
MACHINE_PATH = re.compile(r"(?:^|[\s='\"])(?:/(?:root|tmp|opt|home|work|workspace)/|\$OUT\b)")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split(" | ")]


def index_rows(readme: Path) -> list[str]:
    """The folder column of the index table: the first backticked name of each row's second cell."""
    names, in_index = [], False
    for line in readme.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            in_index = False
            continue
        cells = _cells(line)
        if len(cells) > 1 and cells[1] == "folder":
            in_index = True
        elif in_index and not re.fullmatch(r"[|\s:-]+", line):
            names.append(re.search(r"`([^`]+)`", cells[1]).group(1).rstrip("/"))
    return names


def entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.name not in ("README.md", "archive")}


def _brace_expanded(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [x for alt in match.group(1).split(",")
            for x in _brace_expanded(path[:match.start()] + alt + path[match.end():])]


def _indexed(relative: str) -> bool:
    """Whether a path under examples/results/ belongs to an entry with an index row."""
    parts = relative.strip("/").split("/")
    if parts[0] == "archive" and len(parts) > 1:
        return parts[1] in index_rows(ARCHIVE / "README.md")
    return parts[0] in index_rows(RESULTS / "README.md")


@pytest.mark.parametrize("folder", [RESULTS, ARCHIVE], ids=["results", "archive"])
def test_every_entry_has_one_row_and_every_row_an_entry(folder):
    rows = index_rows(folder / "README.md")
    assert len(rows) == len(set(rows)), sorted(r for r in rows if rows.count(r) > 1)
    assert sorted(entries(folder) - set(rows)) == [], "entries without an index row"
    assert sorted(set(rows) - entries(folder)) == [], "index rows naming no entry"


def test_index_parser_sees_a_missing_row(tmp_path):
    (tmp_path / "run_a").mkdir()
    (tmp_path / "run_b.json").write_text("{}")
    (tmp_path / "README.md").write_text(
        "| what was measured | folder | command | commit | date | hardware |\n|---|---|---|---|---|---|\n"
        "| a | `run_a/` | `moepass bench` | abc1234 | 2026-12-01 | 1x H200 |\n")
    assert index_rows(tmp_path / "README.md") == ["run_a"]
    assert entries(tmp_path) - set(index_rows(tmp_path / "README.md")) == {"run_b.json"}


def test_readme_results_table_points_at_indexed_folders():
    rows = [line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and "examples/results/" in line]
    assert rows, "README.md has no results table linking into examples/results/"
    for row in rows:
        where = _cells(row)[-1]
        tokens = re.findall(r"`([^`\s]+)`", where) + re.findall(r"\]\(([^)\s]+)\)", where)
        paths = [t for t in tokens if t.endswith(("/", ".json", ".txt", ".log"))]
        assert paths, f"a results row names no folder: {row[:120]}"
        for path in paths:
            relative = path.split("examples/results/", 1)[1] if "examples/results/" in path else path
            assert (RESULTS / relative).exists(), f"README.md cites a missing result: {path}"
            assert _indexed(relative), f"README.md cites a result the index has no row for: {path}"


FIGURE = re.compile(r"\d+(?:\.\d+)?[x%]|\d+\.\d+")


def _source_text(relative: str) -> str:
    """What a README results row may quote: the entry's index row and, for a folder, its own README."""
    parts = relative.strip("/").split("/")
    index, name = (ARCHIVE, parts[1]) if parts[0] == "archive" and len(parts) > 1 else (RESULTS, parts[0])
    rows = [line for line in (index / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and len(_cells(line)) > 1 and f"`{name}" in _cells(line)[1]]
    folder = index / name / "README.md"
    return "\n".join(rows) + ("\n" + folder.read_text(encoding="utf-8") if folder.exists() else "")


def test_readme_results_figures_come_from_their_results():
    """Every figure of a README results row (1.268x, 0.24%, 0.963) is written in the index row or folder it links."""
    rows = [line for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines()
            if line.startswith("|") and "examples/results/" in line]
    unsourced = []
    for row in rows:
        *claims, where = _cells(row)
        paths = re.findall(r"examples/results/([^)`\s]+)", where)
        sources = "\n".join(_source_text(p) for p in paths)
        unsourced += [f"{figure} ({paths})" for figure in FIGURE.findall(" | ".join(claims)) if figure not in sources]
    assert unsourced == [], "README.md quotes figures its result rows do not hold"


def test_cited_result_paths_exist():
    sources = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]
    for tree in ("moepass", "passes", "tests"):
        sources += (REPO / tree).rglob("*.py")
    missing = []
    for source in sources:
        for match in CITED.finditer(source.read_text(encoding="utf-8")):
            for relative in _brace_expanded(match.group(1) or ""):
                if not (RESULTS / relative).exists():
                    missing.append(f"{source.relative_to(REPO)}: {match.group(0)}")
    assert missing == []


def _commands(value, key=None):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _commands(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _commands(v, key)
    elif key == "command" and isinstance(value, str):
        yield value


def test_recorded_commands_use_repository_relative_paths():
    machine = []
    for path in sorted(RESULTS.rglob("*.json")):
        for command in _commands(json.loads(path.read_text(encoding="utf-8"))):
            if MACHINE_PATH.search(command):
                machine.append(f"{path.relative_to(RESULTS)}: {command[:100]}")
    assert machine == []
