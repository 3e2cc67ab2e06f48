"""What the passes did: per pass, per graph, with reasons for every node left alone.

A `Report` collects one `GraphRecord` per graph the backend compiled. `to_dict()` is the
stable schema of DESIGN.md; `save(dir)` writes report.json, the readable code of every graph
before and after each pass, and one self-contained HTML page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import html
import json
import os
from collections import Counter

SCHEMA_VERSION = 1


@dataclasses.dataclass
class Rewrite:
    node: str
    module: str
    op: str
    detail: str = ""


@dataclasses.dataclass
class Skip:
    node: str
    module: str
    reason: str


@dataclasses.dataclass
class PassRecord:
    name: str
    rewrites: list[Rewrite] = dataclasses.field(default_factory=list)
    skipped: list[Skip] = dataclasses.field(default_factory=list)
    ms: float = 0.0
    # implementation name -> why it was chosen (e.g. "emulated" -> "cpu: no MXFP8 tensor cores")
    implementations: dict[str, str] = dataclasses.field(default_factory=dict)
    scope: str = dataclasses.field(default="", repr=False, compare=False)  # HOP body being rewritten ("" at top)

    @contextlib.contextmanager
    def in_scope(self, scope):
        """Record nodes of a HOP body (activation checkpoint, ...) as `<body>/<node>`."""
        previous, self.scope = self.scope, scope.name
        try:
            yield self
        finally:
            self.scope = previous

    def _name(self, node) -> str:
        name = getattr(node, "name", str(node))
        return f"{self.scope}/{name}" if self.scope else name

    def replace(self, node, module: str, op: str, detail: str = "") -> None:
        self.rewrites.append(Rewrite(self._name(node), module, op, detail))

    def skip(self, node, module: str, reason: str) -> None:
        self.skipped.append(Skip(self._name(node), module, reason))


@dataclasses.dataclass(eq=False)
class GraphRecord:
    index: int
    code_before: str
    code_after: dict[str, str]  # pass name -> code after that pass
    ops_before: Counter
    ops_after: Counter
    passes: list[PassRecord]
    # one entry per post-grad graph Inductor compiled from it: {"kind": "forward"|"backward", "ops": {...}}
    compiled: list[dict] = dataclasses.field(default_factory=list)
    replayed: bool = False  # run from Dynamo's cache: compiled before the report that holds it began


class Report:
    def __init__(self, config: dict | None = None):
        self.config = config or {}
        self.graphs: list[GraphRecord] = []
        self.graph_breaks = 0
        self.frames_eager = 0  # frames Dynamo gave up on: run in eager, never rewritten (collect.dynamo_counts)
        self._sources: set[int] = set()  # ids of the backend's records already held

    def add_graph(self, record: GraphRecord, replayed: bool = False) -> None:
        """Hold one compiled graph's record (a copy: its index is this report's). A graph Dynamo serves
        from its cache is added when it runs (`replayed`), once."""
        if id(record) in self._sources:
            return
        self._sources.add(id(record))
        self.graphs.append(dataclasses.replace(record, index=len(self.graphs), replayed=replayed))

    @property
    def compiled(self) -> list[dict]:
        """The post-grad graphs Inductor compiled from this report's graphs (forward, then backward when run)."""
        return [c for g in self.graphs for c in g.compiled]

    @property
    def replayed(self) -> int:
        return sum(g.replayed for g in self.graphs)

    def pass_totals(self) -> list[PassRecord]:
        """Each pass's records merged over all graphs, in pipeline order."""
        merged: dict[str, PassRecord] = {}
        for g in self.graphs:
            for p in g.passes:
                m = merged.setdefault(p.name, PassRecord(p.name))
                m.rewrites += p.rewrites
                m.skipped += p.skipped
                m.ms += p.ms
                m.implementations.update(p.implementations)
        return list(merged.values())

    def ops_before(self) -> Counter:
        return sum((g.ops_before for g in self.graphs), Counter())

    def ops_after(self) -> Counter:
        return sum((g.ops_after for g in self.graphs), Counter())

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "passes": [
                {
                    "name": p.name,
                    "replaced": len(p.rewrites),
                    "skipped": [dataclasses.asdict(s) for s in p.skipped],
                    "ms": round(p.ms, 3),
                    "rewrites": [dataclasses.asdict(r) for r in p.rewrites],
                    "implementations": p.implementations,
                }
                for p in self.pass_totals()
            ],
            "graphs": len(self.graphs),
            "replayed_graphs": self.replayed,
            "graph_breaks": self.graph_breaks,
            "frames_run_eagerly": self.frames_eager,
            "ops_before": dict(sorted(self.ops_before().items())),
            "ops_after": dict(sorted(self.ops_after().items())),
            "compiled_graphs": self.compiled,
            "config": self.config,
        }

    def summary(self) -> str:
        """A terminal table: one row per pass, then every skipped node with its reason."""
        replayed = (f" ({self.replayed} served from Dynamo's cache, compiled before this report began; their "
                    "graph breaks were counted then)") if self.replayed else ""
        lines = [f"moepass: {len(self.graphs)} graph(s), {self.graph_breaks} graph break(s){replayed}",
                 f"{'pass':<18} {'replaced':>8} {'skipped':>8} {'ms':>8}  implementation"]
        if self.frames_eager:
            lines.insert(1, f"warning: {self.frames_eager} frame(s) fell back to eager (graph breaks Dynamo could not "
                            "split at: inside an activation-checkpointed layer, in a loop); the GEMMs they run "
                            "themselves never reach moepass and stay BF16 (TORCH_LOGS=graph_breaks says where)")
        for p in self.pass_totals():
            impl = "; ".join(f"{k}: {v}" for k, v in p.implementations.items()) or "-"
            lines.append(f"{p.name:<18} {len(p.rewrites):>8} {len(p.skipped):>8} {p.ms:>8.1f}  {impl}")
        groups: dict[tuple[str, str], list[str]] = {}
        for p in self.pass_totals():
            for s in p.skipped:
                groups.setdefault((p.name, s.reason), []).append(s.module or "<top>")
        if groups:
            lines.append("skipped (left in BF16 / unchanged):")
            for (name, reason), modules in groups.items():
                shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
                lines.append(f"  [{name}] {shown}: {reason}")
        return "\n".join(lines)

    def save(self, directory: str) -> str:
        """Write report.json, graph_<i>_<stage>.py and report.html; return the HTML path."""
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "report.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, default=str)
        for g in self.graphs:
            _write(os.path.join(directory, f"graph_{g.index}_0_before.py"), g.code_before)
            for i, (name, code) in enumerate(g.code_after.items(), start=1):
                _write(os.path.join(directory, f"graph_{g.index}_{i}_after_{name}.py"), code)
        path = os.path.join(directory, "report.html")
        _write(path, self.to_html())
        return path

    def to_html(self) -> str:
        d = self.to_dict()
        e = html.escape
        out = [f"<!doctype html><html><head><meta charset='utf-8'><title>moepass report</title>"
               f"<style>{_CSS}</style></head><body>",
               f"<h1>moepass report</h1><p>{d['graphs']} graph(s) compiled, "
               f"{d['graph_breaks']} graph break(s).</p>",
               "<h2>Passes</h2><table><tr><th>pass</th><th>replaced</th><th>skipped</th><th>ms</th>"
               "<th>implementation (why)</th></tr>"]
        for p in d["passes"]:
            impl = "<br>".join(f"<b>{e(k)}</b>: {e(v)}" for k, v in p["implementations"].items()) or "-"
            out.append(f"<tr><td>{e(p['name'])}</td><td>{p['replaced']}</td><td>{len(p['skipped'])}</td>"
                       f"<td>{p['ms']}</td><td>{impl}</td></tr>")
        out.append("</table><h2>What changed, where</h2><table><tr><th>pass</th><th>module</th><th>node</th>"
                   "<th>now</th><th>detail</th></tr>")
        for p in d["passes"]:
            for r in p["rewrites"]:
                out.append(f"<tr><td>{e(p['name'])}</td><td>{e(r['module'] or '<top>')}</td><td>{e(r['node'])}</td>"
                           f"<td><code>{e(r['op'])}</code></td><td>{e(r['detail'])}</td></tr>")
        out.append("</table><h2>What was left alone, and why</h2><table><tr><th>pass</th><th>module</th>"
                   "<th>node</th><th>reason</th></tr>")
        for p in d["passes"]:
            for s in p["skipped"]:
                out.append(f"<tr class='skip'><td>{e(p['name'])}</td><td>{e(s['module'] or '<top>')}</td>"
                           f"<td>{e(s['node'])}</td><td>{e(s['reason'])}</td></tr>")
        out.append("</table><h2>Ops before and after</h2><table><tr><th>op</th><th>before</th><th>after</th></tr>")
        for op in sorted(set(d["ops_before"]) | set(d["ops_after"])):
            b, a = d["ops_before"].get(op, 0), d["ops_after"].get(op, 0)
            cls = " class='changed'" if a != b else ""
            out.append(f"<tr{cls}><td><code>{e(op)}</code></td><td>{b}</td><td>{a}</td></tr>")
        out.append("</table><h2>GEMMs in the graphs Inductor compiled (after AOTAutograd)</h2>"
                   "<table><tr><th>#</th><th>kind</th><th>ops</th></tr>")
        for i, c in enumerate(d["compiled_graphs"]):
            ops = ", ".join(f"{e(k)}&times;{v}" for k, v in c["ops"].items()) or "-"
            out.append(f"<tr><td>{i}</td><td>{c['kind']}</td><td><code>{ops}</code></td></tr>")
        out.append("</table><h2>Graphs</h2>")
        for g in self.graphs:
            final = list(g.code_after.values())[-1] if g.code_after else g.code_before
            out.append(f"<details><summary>graph {g.index}: diff before → after all passes</summary>"
                       f"{_diff_html(g.code_before, final)}</details>")
            out.append(f"<details><summary>graph {g.index}: code after all passes</summary>"
                       f"<pre>{e(final)}</pre></details>")
        out.append("</body></html>")
        return "\n".join(out)


def _diff_html(before: str, after: str) -> str:
    rows = []
    for line in difflib.unified_diff(before.splitlines(), after.splitlines(), "before", "after", lineterm="", n=1):
        cls = "add" if line.startswith("+") else "del" if line.startswith("-") else "ctx"
        rows.append(f"<span class='{cls}'>{html.escape(line)}</span>")
    return "<pre>" + "\n".join(rows) + "</pre>"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f0f0f0}tr.skip td{background:#fff8e6}tr.changed td{background:#eef6ff}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px}.add{color:#070;background:#e6ffe6}
.del{color:#900;background:#ffe6e6}.ctx{color:#555}summary{cursor:pointer;margin:.5em 0}"""
