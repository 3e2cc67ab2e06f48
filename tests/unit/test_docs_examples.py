"""Every ```python and ```bash block of README.md and docs/*.md runs as written, or is parsed and its flags checked.

The line right before a fence may mark the block (docs/README.md, "Examples"):
    (none)                          runs in CI: python in a process of its own, bash under `bash -e`, in a fresh
                                    directory
    <!-- example: extended -->      runs only under `pytest -m extended` (long CPU runs)
    <!-- example: gpu -->, multigpu, nodes, setup
                                    parsed only (ast.parse; bash -n), every `moepass <command>` line checked against
                                    the CLI's parser and every literal `options=` dict against the options
    <!-- example: continues -->     a python block continuing the page's previous python block: the chain runs as one
    <!-- example: output -->       shown output, never run
A runnable block's directory links the repository's top-level entries (`python examples/x.py` works as from the
repository root); `pip` is a shell function that only says it was not run, so no block installs anything.
A python block runs as `python docs_example.py` would, in a process forked from one that imported torch and moepass
once (a fresh interpreter's imports were most of a short block's seconds); nothing one block does reaches another.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# docs/ as the plan has it (.notes/docs_plan.md): each page exists and docs/README.md links it
PLAN = ("install.md", "integrations.md", "recipes.md", "passes.md", "options.md", "inspection.md", "measuring.md",
        "expert-parallel.md", "architecture.md", "limitations.md", "troubleshooting.md")

MARKER = re.compile(r"^\s*<!--\s*example:\s*([\w-]+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
KINDS = ("ci", "extended", "gpu", "multigpu", "nodes", "setup", "continues", "output")
PARSE_ONLY = ("gpu", "multigpu", "nodes", "setup")
CI_TIMEOUT_S = 540  # under pytest-timeout's 600 (pyproject)
EXTENDED_TIMEOUT_S = 3000
PIP_SHIM = 'pip() { echo "(docs example: pip $* not run)"; }\npip3() { pip "$@"; }\n'


@dataclasses.dataclass
class Block:
    page: str   # relative to the repository root
    line: int   # of the opening fence, 1-based
    lang: str   # python | bash
    marker: str  # one of KINDS
    code: str
    chain: list["Block"] = dataclasses.field(default_factory=list)  # python: the blocks this one continues, and itself
    followed: bool = False  # a later block continues this one: it runs as part of that one

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """How the block is tested: a continuing block as the chain's first block says."""
        return self.chain[0].marker if self.marker == "continues" and self.chain else self.marker


def read_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    page = path.relative_to(ROOT).as_posix()
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang = fence.group(1), fence.group(2).lower()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        if lang in ("python", "py", "bash", "sh", "shell"):
            marked = MARKER.match(lines[i - 1]) if i > 0 else None
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:end])
            blocks.append(Block(page, i + 1, "python" if lang in ("python", "py") else "bash",
                                marked.group(1) if marked else "ci", textwrap.dedent(body) + "\n"))
        i = end + 1
    previous = None
    for b in blocks:
        if b.lang != "python":
            continue
        if b.marker == "continues" and previous is not None:
            b.chain = [*previous.chain, b]
            previous.followed = True
        else:
            b.chain = [b]
        previous = b
    return blocks


BLOCKS = [b for page in PAGES for b in read_blocks(page)]


def _param(b: Block):
    marks = [pytest.mark.extended, pytest.mark.timeout(EXTENDED_TIMEOUT_S + 60)] if b.kind == "extended" else []
    return pytest.param(b, id=b.id, marks=marks)


# ---------------------------------------------------------------- running a block


def _workdir(tmp_path: Path) -> Path:
    """A fresh directory holding links to the repository's top-level entries, as a user's checkout would."""
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("build", "dist") and not entry.name.endswith(
                ".egg-info"):
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


def _run(argv: list[str], cwd: Path, timeout: int, what: str) -> None:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        said = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x for x in (e.stdout, e.stderr) if x)
        pytest.fail(f"{what} ran past {timeout} s\n--- output (tail) ---\n{said[-12000:]}")
    output = (done.stdout + done.stderr)[-12000:]
    assert done.returncode == 0, f"{what} exited {done.returncode}\n--- output (tail) ---\n{output}"
    print(f"{what}: exit 0\n{output[-2000:]}")


def _python_in_child(script: str, output: str) -> None:
    """`python script` in the script's directory, its output to `output`: an exception exits 1 with its traceback,
    sys.exit(n) exits n (multiprocessing's child does what the interpreter does)."""
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    directory = os.path.dirname(script)
    os.chdir(directory)
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    # what the tests put on the path, or imported, a user's `python docs_example.py` does not have
    tests = str(ROOT / "tests")
    for name in [n for n, m in sys.modules.items() if (getattr(m, "__file__", None) or "").startswith(tests)]:
        del sys.modules[name]
    sys.argv, sys.path[:] = [script], [directory, *(p for p in sys.path if not p.startswith(tests))]
    runpy.run_path(script, run_name="__main__")


def _run_python(script: Path, timeout: int, what: str) -> None:
    from rank_shared import preloaded_context  # this process's one forkserver: the rank pools' (torch, moepass loaded)

    output = script.parent.with_suffix(".out")  # beside the block's directory: the block sees only what it made there
    child = preloaded_context().Process(target=_python_in_child, args=(str(script), str(output)))
    child.start()
    try:
        child.join(timeout)
        ran_past = child.is_alive()
    finally:  # also when the test itself is interrupted: no block outlives its test
        if child.is_alive():
            child.kill()
            child.join()
    said = output.read_text(errors="replace")[-12000:] if output.exists() else ""
    if ran_past:
        pytest.fail(f"{what} ran past {timeout} s\n--- output (tail) ---\n{said}")
    assert child.exitcode == 0, f"{what} exited {child.exitcode}\n--- output (tail) ---\n{said}"
    print(f"{what}: exit 0\n{said[-2000:]}")


def _run_block(b: Block, tmp_path: Path, timeout: int) -> None:
    cwd = _workdir(tmp_path)
    if b.lang == "python":
        script = cwd / "docs_example.py"
        script.write_text("\n".join(x.code for x in b.chain))
        what = f"python block {b.id}" + (f" (with {', '.join(x.id for x in b.chain[:-1])})" if len(b.chain) > 1 else "")
        _run_python(script, timeout, what)
    else:
        script = cwd / "docs_example.sh"
        script.write_text(PIP_SHIM + b.code)
        _run(["bash", "-e", str(script)], cwd, timeout, f"bash block {b.id}")


# ---------------------------------------------------------------- checking a block that is not run


def _shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a bash block, as argv lists (continued lines joined, comments dropped)."""
    commands, pending = [], ""
    for line in code.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        lexer = shlex.shlex(pending, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            tokens = list(lexer)
        except ValueError:  # a quote open over the line's end: read on
            continue
        pending, current = "", []
        for token in tokens:
            if token and set(token) <= set("&|;()<>"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def moepass_invocations(code: str, subcommands) -> list[list[str]]:
    """Each `moepass <command> ...` (also `python -m moepass.cli`, `torchrun ... -m moepass.cli`): [command, *args]."""
    found = []
    for argv in _shell_commands(code):
        words = [w for w in argv if not w.startswith("$")]  # a shell variable is checked where it is set
        first = next((i for i, w in enumerate(words) if not re.match(r"^\w+=", w)), None)
        for i, w in enumerate(words):
            named = w == "moepass" or w.endswith("/moepass") or (w in ("moepass.cli", "moepass") and i and
                                                                  words[i - 1] == "-m")
            if named and (i == first or (i + 1 < len(words) and words[i + 1] in subcommands)):
                found.append(words[i + 1:])
                break
    return found


def _check_cli(argv: list[str], parser, where: str) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"{where}: `moepass {shlex.join(argv)}` is refused by the CLI:\n{err.getvalue()}"


def _literal_options(code: str) -> list[dict]:
    """The literal dicts a python block passes as `options=` (torch.compile, moepass.inspect, install)."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "options":
                    with contextlib.suppress(ValueError, SyntaxError):
                        value = ast.literal_eval(kw.value)
                        if isinstance(value, dict):
                            found.append(value)
    return found


def _check_parsed(b: Block) -> None:
    from moepass.cli import build_parser
    from moepass.options import Config

    if b.lang == "python":
        code = "\n".join(x.code for x in b.chain)
        ast.parse(code, filename=b.id)
        for options in _literal_options(code):
            Config.from_options(options)  # raises OptionsError naming the bad key or value
        return
    done = subprocess.run(["bash", "-n"], input=b.code, capture_output=True, text=True)
    assert done.returncode == 0, f"bash -n refuses {b.id}:\n{done.stderr}"
    parser = build_parser()
    subcommands = set(parser._subparsers._group_actions[0].choices)
    for argv in moepass_invocations(b.code, subcommands):
        assert argv and argv[0] in subcommands, f"{b.id}: `moepass {shlex.join(argv)}`: no such command"
        _check_cli(argv, parser, b.id)
    for match in re.finditer(r"MOEPASS_OPTIONS='([^']*)'", b.code):
        Config.from_options(json.loads(match.group(1)))


# ---------------------------------------------------------------- the tests


def test_blocks_are_found():
    assert BLOCKS, "no python or bash block in README.md or docs/"
    bad = [f"{b.id}: marker {b.marker!r}" for b in BLOCKS if b.marker not in KINDS]
    bad += [f"{b.id}: `continues` with no python block before it" for b in BLOCKS
            if b.marker == "continues" and (b.lang != "python" or len(b.chain) < 2)]
    assert not bad, "unknown or misplaced markers (valid: " + ", ".join(KINDS) + "):\n" + "\n".join(bad)
    counts = {k: sum(b.kind == k for b in BLOCKS if b.marker != "output") for k in ("ci", "extended", *PARSE_ONLY)}
    print("docs blocks by kind:", counts)


def test_no_unmarked_block_installs():
    """A block that pip-installs is a set-up step for the reader; it is marked, and never installs in a test."""
    unmarked = [b.id for b in BLOCKS if b.lang == "bash" and b.marker == "ci" and re.search(r"\bpip3? install\b", b.code)]
    assert not unmarked, f"mark these blocks (extended or parse-only): {unmarked}"


def test_no_runnable_block_runs_the_test_suite():
    """`pytest` inside a docs example would run the suite inside one of its own tests."""
    def runs_pytest(argv: list[str]) -> bool:
        argv = list(itertools.dropwhile(lambda w: re.match(r"^\w+=", w), argv))  # environment assignments
        return argv[:1] == ["pytest"] or (argv[:1] in (["python"], ["python3"]) and argv[1:3] == ["-m", "pytest"])

    runs = [b.id for b in BLOCKS if b.lang == "bash" and b.kind in ("ci", "extended")
            and any(runs_pytest(argv) for argv in _shell_commands(b.code))]
    assert not runs, f"mark these blocks `<!-- example: setup -->` (parsed only): {runs}"


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_docs_example(block: Block, tmp_path, monkeypatch):
    if block.marker == "output":
        assert block.code.strip(), f"{block.id}: an empty output block"
        return
    if block.kind in PARSE_ONLY or block.followed:
        monkeypatch.chdir(tmp_path)  # an option check creates report_dir: here, not in the repository
        _check_parsed(block)  # a followed block runs inside the chain that continues it
        return
    if block.kind == "extended":
        _run_block(block, tmp_path, EXTENDED_TIMEOUT_S)
        return
    assert block.kind == "ci", f"{block.id}: marker {block.marker!r}"
    _run_block(block, tmp_path, CI_TIMEOUT_S)


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"^[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PLAN)
def test_plan_page_exists_and_is_indexed(page):
    assert (DOCS / page).is_file(), f"docs/{page} is missing"
    index = (DOCS / "README.md").read_text()
    assert re.search(rf"\]\((\./)?{re.escape(page)}(#[\w-]*)?\)", index), f"docs/README.md does not link {page}"
