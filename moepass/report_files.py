"""A report on disk: what `Report.save(dir)` writes, and writes again as graphs are added and compiled.

    report.json    totals over every graph of the report (DESIGN.md's schema, `Report.to_dict()`)
    index.json     totals per pass and one line per graph and per torch.compile call (`Report.index()`)
    report.html    both as one page: totals, one row per graph linking its page, every rewrite and skip
    graphs/<i>/report.json, graphs/<i>/report.html      graph i's own report (its page shows its diff and code)
    graph_<i>_0_before.py, graph_<i>_<k>_after_<pass>.py  graph i's code before, and after each pass

Each file is written beside its place and renamed over it, so a reader never sees half a file.
"""

from __future__ import annotations

import difflib
import html
import json
import os
import re
import shutil

# the files a report writes, and nothing else: only these are cleared from a directory a report first saves to
_OWN_GRAPH_CODE = re.compile(r"graph_\d+_\d+_(before|after_\w+)\.py")
_OWN_GRAPH_DIR = re.compile(r"\d+")
_RUN_LEVEL = ("graph_breaks", "frames_run_eagerly", "replayed_graphs")  # not a graph's own: left out of its report


def save(report, directory: str, changed=None) -> str:
    """Write `report` to `directory`; return report.html's path. The totals are always written; of the graphs,
    only `changed` ones (None: all) once this report has written every graph here."""
    os.makedirs(directory, exist_ok=True)
    key = os.path.abspath(directory)
    if key not in report.saved_dirs:
        _clear_graph_files(directory)  # an earlier run's graphs would disagree with this index
        changed = None
    for g in report.graphs if changed is None else changed:
        _save_graph(report, g, directory)
    _write(os.path.join(directory, "report.json"), _json(report.to_dict()))
    _write(os.path.join(directory, "index.json"), _json(report.index()))
    path = os.path.join(directory, "report.html")
    _write(path, report_page(report))
    report.saved_dirs.add(key)
    return path


def graph_dict(report, graph) -> dict:
    """One graph's own report: `to_dict()`'s schema over that graph alone, and its index line as "graph"."""
    d = report.only(graph).to_dict()
    for key in _RUN_LEVEL:
        d.pop(key)
    return {**d, "graph": graph.line()}


def _save_graph(report, g, directory: str) -> None:
    folder = os.path.join(directory, "graphs", str(g.index))
    os.makedirs(folder, exist_ok=True)
    _write(os.path.join(folder, "report.json"), _json(graph_dict(report, g)))
    _write(os.path.join(folder, "report.html"), graph_page(report, g))
    _write(os.path.join(directory, f"graph_{g.index}_0_before.py"), g.code_before)
    for i, (name, code) in enumerate(g.code_after.items(), start=1):
        _write(os.path.join(directory, f"graph_{g.index}_{i}_after_{name}.py"), code)


def _clear_graph_files(directory: str) -> None:
    for name in os.listdir(directory):
        if _OWN_GRAPH_CODE.fullmatch(name):
            os.remove(os.path.join(directory, name))
    graphs = os.path.join(directory, "graphs")
    if os.path.isdir(graphs):
        for name in os.listdir(graphs):
            folder = os.path.join(graphs, name)
            if _OWN_GRAPH_DIR.fullmatch(name) and set(os.listdir(folder)) <= {"report.json", "report.html"}:
                shutil.rmtree(folder)


def report_page(report) -> str:
    """The report's page: totals, one row per graph (linking graphs/<i>/report.html), every rewrite and skip."""
    d = report.to_dict()
    calls = f" from {d['compile_calls']} torch.compile call(s)" if d["compile_calls"] > 1 else ""
    eager = (f" <b>{d['frames_run_eagerly']} frame(s) fell back to eager</b>: their GEMMs stay BF16."
             if d["frames_run_eagerly"] else "")
    intro = f"<p>{d['graphs']} graph(s) compiled{calls}, {d['graph_breaks']} graph break(s).{eager}</p>"
    return _page("moepass report", intro, report, link_graphs=True, code=False)


def graph_page(report, graph) -> str:
    """Graph `graph`'s page: what each pass did to it, its ops, its compiled graphs, its diff and code."""
    line = graph.line()
    intro = (f"<p><a href='../../report.html'>all graphs</a> &middot; torch.compile call {line['compile_call']}, "
             f"Dynamo compile id {html.escape(line['compile_id'] or '-')}, "
             f"traced {html.escape(line['frame'] or '-')}, module {html.escape(line['module'] or '-')}</p>")
    return _page(f"moepass report: graph {graph.index}", intro, report.only(graph), link_graphs=False, code=True)


def _page(title: str, intro: str, report, link_graphs: bool, code: bool) -> str:
    e = html.escape
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
           f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>{intro}",
           "<h2>Passes</h2><table><tr><th>pass</th><th>replaced</th><th>skipped</th><th>ms</th>"
           "<th>implementation (why)</th></tr>"]
    for p in report.pass_totals():
        impl = "<br>".join(f"<b>{e(k)}</b>: {e(v)}" for k, v in p.implementations.items()) or "-"
        out.append(f"<tr><td>{e(p.name)}</td><td>{len(p.rewrites)}</td><td>{len(p.skipped)}</td>"
                   f"<td>{p.ms:.3f}</td><td>{impl}</td></tr>")
    out.append("</table><h2>Graphs</h2><table><tr><th>graph</th><th>torch.compile call</th><th>compile id</th>"
               "<th>module</th><th>traced</th><th>replaced</th><th>skipped</th><th>compiled by Inductor</th></tr>")
    for g in report.graphs:
        line = g.line()
        name = f"<a href='graphs/{g.index}/report.html'>{g.index}</a>" if link_graphs else str(g.index)
        replaced = ", ".join(f"{e(k)} {v}" for k, v in line["replaced"].items() if v) or "-"
        out.append(f"<tr><td>{name}</td><td>{line['compile_call']}</td><td>{e(line['compile_id'] or '-')}</td>"
                   f"<td>{e(line['module'] or '-')}</td><td>{e(line['frame'] or '-')}</td><td>{replaced}</td>"
                   f"<td>{sum(line['skipped'].values())}</td><td>{e(', '.join(line['compiled']) or '-')}</td></tr>")
    out.append("</table><h2>What changed, where</h2><table><tr><th>graph</th><th>pass</th><th>module</th>"
               "<th>node</th><th>now</th><th>detail</th></tr>")
    for g in report.graphs:
        for p in g.passes:
            for r in p.rewrites:
                out.append(f"<tr><td>{g.index}</td><td>{e(p.name)}</td><td>{e(r.module or '<top>')}</td>"
                           f"<td>{e(r.node)}</td><td><code>{e(r.op)}</code></td><td>{e(r.detail)}</td></tr>")
    out.append("</table><h2>What was left alone, and why</h2><table><tr><th>graph</th><th>pass</th><th>module</th>"
               "<th>node</th><th>reason</th></tr>")
    for g in report.graphs:
        for p in g.passes:
            for s in p.skipped:
                out.append(f"<tr class='skip'><td>{g.index}</td><td>{e(p.name)}</td><td>{e(s.module or '<top>')}</td>"
                           f"<td>{e(s.node)}</td><td>{e(s.reason)}</td></tr>")
    out.append("</table><h2>Ops before and after</h2><table><tr><th>op</th><th>before</th><th>after</th></tr>")
    before, after = report.ops_before(), report.ops_after()
    for op in sorted(set(before) | set(after)):
        cls = " class='changed'" if after[op] != before[op] else ""
        out.append(f"<tr{cls}><td><code>{e(op)}</code></td><td>{before[op]}</td><td>{after[op]}</td></tr>")
    out.append("</table><h2>GEMMs in the graphs Inductor compiled (after AOTAutograd)</h2>"
               "<table><tr><th>graph</th><th>kind</th><th>ops</th></tr>")
    for c in report.compiled:
        ops = ", ".join(f"{e(k)}&times;{v}" for k, v in c["ops"].items()) or "-"
        out.append(f"<tr><td>{c['graph']}</td><td>{c['kind']}</td><td><code>{ops}</code></td></tr>")
    out.append("</table>")
    if code:
        for g in report.graphs:
            final = list(g.code_after.values())[-1] if g.code_after else g.code_before
            out.append(f"<details open><summary>graph {g.index}: diff before → after all passes</summary>"
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


def _json(d: dict) -> str:
    return json.dumps(d, indent=2, default=str)


def _write(path: str, text: str) -> None:
    partial = f"{path}.{os.getpid()}.partial"  # per process: ranks sharing a report_dir do not collide mid-write
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f0f0f0}tr.skip td{background:#fff8e6}tr.changed td{background:#eef6ff}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px}.add{color:#070;background:#e6ffe6}
.del{color:#900;background:#ffe6e6}.ctx{color:#555}summary{cursor:pointer;margin:.5em 0}"""
