"""A report on disk: what `Report.save(dir)` writes, and writes again as graphs are added and compiled.

    report.json    totals over every graph of the report (`Report.to_dict()`'s schema, docs/inspection.md)
    index.json     totals per pass and one line per graph and per torch.compile call (`Report.index()`)
    report.html    both as one page: first the coverage (low-precision share of GEMM FLOPs, GEMMs by outcome) and
                   what each GEMM became with identical layers folded, one row per graph linking its page; the
                   rest (passes, rewrites and skips folded, ops, compiled graphs) one click away in <details>
    graphs/<i>/report.json, graphs/<i>/report.html      graph i's own report (its page adds every GEMM, every
                   rewrite and skip one row each, its diff and code)
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

from .collapse import fold_records, layer_key, pattern, ranges
from .coverage import NOT_SKIP_CODES, WGRAD_BF16, share_text
from ..skips import SkipCode

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
    """The report's page. Its first screen: the coverage (the low-precision share of GEMM FLOPs, GEMMs by outcome)
    and what each GEMM became, identical layers folded; a table of graphs linking each graph's page; the rest one
    click away in <details>."""
    d = report.to_dict()
    calls = f" from {d['compile_calls']} torch.compile call(s)" if d["compile_calls"] > 1 else ""
    eager = (f" <b>{d['frames_run_eagerly']} frame(s) fell back to eager</b>: their GEMMs stay BF16."
             if d["frames_run_eagerly"] else "")
    intro = f"<p>{d['graphs']} graph(s) compiled{calls}, {d['graph_breaks']} graph break(s).{eager}</p>"
    return _page("moepass report", intro, report, own_graph=False)


def graph_page(report, graph) -> str:
    """Graph `graph`'s page: its coverage and what each pass did to it, every GEMM and record, its diff and code."""
    line = graph.line()
    intro = (f"<p><a href='../../report.html'>all graphs</a> &middot; torch.compile call {line['compile_call']}, "
             f"Dynamo compile id {html.escape(line['compile_id'] or '-')}, "
             f"traced {html.escape(line['frame'] or '-')}, module {html.escape(line['module'] or '-')}</p>")
    return _page(f"moepass report: graph {graph.index}", intro, report.only(graph), own_graph=True)


def _page(title: str, intro: str, report, own_graph: bool) -> str:
    e = html.escape
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
           f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>{intro}", _coverage_html(report.coverage())]
    folded = report.folded_gemms()
    out.append("<h2>What each GEMM became <small>(identical layers folded)</small></h2>"
               "<table><tr><th>modules</th><th>GEMMs</th><th>became</th><th>modules alike</th></tr>")
    for f in folded:
        out.append(f"<tr class='{f.status}'><td>{e(f.modules or '<top>')}</td><td>{e(', '.join(f.names))}</td>"
                   f"<td>{e(f.outcome)}</td><td>{'&times;' + str(f.count) if f.count > 1 else ''}</td></tr>")
    out.append("</table>")
    if not own_graph:
        out.append(_graphs_html(report))
    out.append(_details("Passes: replaced, skipped, time, implementation", _passes_html(report)))
    rewrites = [(p.name, r) for p in report.pass_totals() for r in p.rewrites]
    out.append(_details(f"What each pass changed ({len(rewrites)} rewrites, identical layers folded)",
                        _folded_html(fold_records(rewrites, lambda r: f"{r.op} {r.detail}"), "now")))
    skips = [(p.name, s) for p in report.pass_totals() for s in p.skipped]
    out.append(_details(f"What was left alone, and why ({len(skips)} skips, identical layers folded)",
                        _folded_html(fold_records(skips, lambda s: s.reason), "reason")))
    out.append(_details("Ops before and after the passes", _ops_html(report)))
    out.append(_details("GEMMs in the graphs Inductor compiled (after AOTAutograd)", _compiled_html(report)))
    if own_graph:
        out.append(_details(f"Every GEMM ({sum(len(g.gemms) for g in report.graphs)}), one row each",
                            _gemms_html(report)))
        out.append(_details("Every rewrite and skip, one row each", _records_html(report)))
        for g in report.graphs:
            final = list(g.code_after.values())[-1] if g.code_after else g.code_before
            out.append(f"<details open><summary>graph {g.index}: diff before → after all passes</summary>"
                       f"{_diff_html(g.code_before, final)}</details>")
            out.append(f"<details><summary>graph {g.index}: code after all passes</summary>"
                       f"<pre>{e(final)}</pre></details>")
    out.append("</body></html>")
    return "\n".join(out)


def _coverage_html(cov: dict) -> str:
    """The first screen: the share of weight-GEMM FLOPs in low precision, and the GEMMs by outcome."""
    e = html.escape
    share = cov["low_precision_flop_share"]
    flops = cov["flops"]
    bf16 = "".join(f"<li><b>{e(code)}</b>: {n} GEMM(s), {_share(flops['bf16'].get(code, 0), flops['total'])} of "
                   f"the FLOPs{_why(code)}</li>" for code, n in cov["bf16"].items())
    if flops["bf16"].get(WGRAD_BF16):
        bf16 += (f"<li><b>{WGRAD_BF16}</b>: {_share(flops['bf16'][WGRAD_BF16], flops['total'])} of the FLOPs"
                 f"{_why(WGRAD_BF16)}</li>")
    missing = "".join(f"<li>{e(u['op'])} at <code>{e(u['module'] or '<top>')}</code> (graph {u.get('graph', '-')}, "
                      f"node {e(u['node'])}){' ' + e(u['note']) if u.get('note') else ''}</li>"
                      for u in cov["unaccounted_gemms"])
    out = [f"<div class='coverage'><p><span class='share'>{share_text(share)}</span> "
           "of the weight GEMMs' FLOPs run in low precision (forward, dgrad and wgrad: 3 &times; 2&middot;M&middot;"
           "N&middot;K each)</p><table><tr><th>weight GEMMs</th><th>low precision</th><th>BF16</th>"
           "<th>unaccounted</th><th>activation GEMMs (not counted)</th></tr>"
           f"<tr><td>{cov['gemms']}</td><td>{cov['low_precision']}</td><td>{sum(cov['bf16'].values())}</td>"
           f"<td class='{'bad' if cov['unaccounted'] else ''}'>{cov['unaccounted']}</td><td>{cov['not_weight']}</td>"
           "</tr></table>"]
    if bf16:
        out.append(f"<p>BF16 by reason:</p><ul>{bf16}</ul>")
    if missing:
        out.append("<p class='bad'>Unaccounted (a moepass bug: no pass rewrote these or said why):</p>"
                   f"<ul>{missing}</ul>")
    if cov["flops_estimated"]:
        out.append(f"<p><small>{cov['flops_estimated']} GEMM(s) have data-dependent sizes: their FLOPs use the rows "
                   "an expert-parallel exchange sends, else Inductor's fallback size.</small></p>")
    out.append("<p><small>Activation GEMMs (attention scores, SDPA) multiply no weight: listed below, outside the "
               "share.</small></p></div>")
    return "".join(out)


def _why(code: str) -> str:
    """What a BF16 reason means and what to do: a skip code's why and fix (moepass.skips), or coverage's own."""
    found = SkipCode.__members__.get(code)
    why, fix = (found.why, found.fix) if found is not None else NOT_SKIP_CODES.get(code, ("", "-"))
    return (f" &mdash; {_code_spans(why)}" if why else "") + (f" (fix: {_code_spans(fix)})" if fix != "-" else "")


def _code_spans(text: str) -> str:
    """Escaped text with its `backticked` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


def _share(part: int, total: int) -> str:
    return f"{part / total * 100:.1f}%" if total else "-"


def _details(summary: str, body: str, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{html.escape(summary)}</summary>{body}</details>"


def _graphs_html(report) -> str:
    """Coverage and rewrites per graph: graphs alike but for their layer (torchtitan compiles each block apart)
    folded into one row, each linking the first one's page; every graph one row each, one click away."""
    e = html.escape
    head = ("<table><tr><th>graph</th><th>module</th><th>traced</th><th>weight GEMMs</th><th>low precision</th>"
            "<th>BF16</th><th>unaccounted</th><th>low-precision FLOPs</th><th>replaced</th><th>compiled by Inductor"
            "</th></tr>")
    folded: dict[tuple, list] = {}
    for g in report.graphs:
        line, cov = g.line(), g.coverage()
        key, numbers = layer_key(line["module"])
        shown = (cov["gemms"], cov["low_precision"], sum(cov["bf16"].values()), cov["unaccounted"],
                 share_text(cov["low_precision_flop_share"]),
                 ", ".join(f"{k} {v}" for k, v in line["replaced"].items() if v) or "-",
                 ", ".join(line["compiled"]) or "-")
        folded.setdefault((key, line["frame"], shown), []).append((g.index, numbers))
    rows = [head]
    for (key, frame, shown), members in folded.items():
        first = members[0][0]
        graphs = ranges(i for i, _ in members)
        module = pattern(key, [n for _, n in members]) or "-"
        rows.append(f"<tr><td><a href='graphs/{first}/report.html'>{graphs}</a></td><td>{e(module)}</td>"
                    f"<td>{e(frame or '-')}</td>" + "".join(
                        f"<td{_bad(i == 3 and v)}>{e(str(v))}</td>" for i, v in enumerate(shown)) + "</tr>")
    out = [f"<h2>Graphs ({len(report.graphs)}): coverage per graph, graphs alike folded</h2>", *rows, "</table>"]
    every = [head.replace("<th>graph</th>", "<th>graph</th><th>torch.compile call</th>")]
    for g in report.graphs:
        line, cov = g.line(), g.coverage()
        replaced = ", ".join(f"{e(k)} {v}" for k, v in line["replaced"].items() if v) or "-"
        every.append(f"<tr><td><a href='graphs/{g.index}/report.html'>{g.index}</a></td><td>{line['compile_call']}</td>"
                     f"<td>{e(line['module'] or '-')}</td><td>{e(line['frame'] or '-')}</td><td>{cov['gemms']}</td>"
                     f"<td>{cov['low_precision']}</td><td>{sum(cov['bf16'].values())}</td>"
                     f"<td{_bad(cov['unaccounted'])}>{cov['unaccounted']}</td>"
                     f"<td>{share_text(cov['low_precision_flop_share'])}</td><td>{replaced}</td>"
                     f"<td>{e(', '.join(line['compiled']) or '-')}</td></tr>")
    if len(folded) < len(report.graphs):
        out.append(_details(f"Every graph, one row each ({len(report.graphs)})", "".join(every) + "</table>"))
    return "".join(out)


def _bad(flag) -> str:
    return " class='bad'" if flag else ""


def _passes_html(report) -> str:
    e = html.escape
    rows = ["<table><tr><th>pass</th><th>replaced</th><th>skipped</th><th>ms</th><th>implementation (why)</th></tr>"]
    for p in report.pass_totals():
        impl = "<br>".join(f"<b>{e(k)}</b>: {e(v)}" for k, v in p.implementations.items()) or "-"
        rows.append(f"<tr><td>{e(p.name)}</td><td>{len(p.rewrites)}</td><td>{len(p.skipped)}</td>"
                    f"<td>{p.ms:.3f}</td><td>{impl}</td></tr>")
    return "".join(rows) + "</table>"


def _folded_html(folded, what: str) -> str:
    e = html.escape
    rows = [f"<table><tr><th>pass</th><th>modules</th><th>nodes</th><th>{e(what)}</th></tr>"]
    for name, f in folded:
        rows.append(f"<tr><td>{e(name)}</td><td>{e(f.modules or '<top>')}"
                    f"{f' (&times;{f.count})' if f.count > 1 else ''}</td><td>{f.nodes}</td><td>{e(f.outcome)}</td>"
                    "</tr>")
    return "".join(rows) + "</table>"


def _ops_html(report) -> str:
    rows = ["<table><tr><th>op</th><th>before</th><th>after</th></tr>"]
    before, after = report.ops_before(), report.ops_after()
    for op in sorted(set(before) | set(after)):
        cls = " class='changed'" if after[op] != before[op] else ""
        rows.append(f"<tr{cls}><td><code>{html.escape(op)}</code></td><td>{before[op]}</td><td>{after[op]}</td></tr>")
    return "".join(rows) + "</table>"


def _compiled_html(report) -> str:
    rows = ["<table><tr><th>graph</th><th>kind</th><th>ops</th></tr>"]
    for c in report.compiled:
        ops = ", ".join(f"{html.escape(k)}&times;{v}" for k, v in c["ops"].items()) or "-"
        rows.append(f"<tr><td>{c['graph']}</td><td>{c['kind']}</td><td><code>{ops}</code></td></tr>")
    return "".join(rows) + "</table>"


def _gemms_html(report) -> str:
    e = html.escape
    rows = ["<table><tr><th>graph</th><th>node</th><th>module</th><th>weight</th><th>op</th><th>status</th>"
            "<th>reason</th><th>by</th><th>GFLOP (fwd+bwd)</th><th>note</th></tr>"]
    for g in report.graphs:
        for u in g.gemms:
            rows.append(f"<tr class='{u.status}'><td>{g.index}</td><td>{e(u.node)}</td><td>{e(u.module or '<top>')}"
                        f"</td><td>{e(u.weight)}</td><td><code>{e(u.op)}</code></td><td>{u.status}</td>"
                        f"<td>{e(u.code)}</td><td>{e(u.by)}</td><td>{u.flops / 1e9:.4g}"
                        f"{'*' if u.estimated else ''}</td><td>{e(u.note)}</td></tr>")
    return "".join(rows) + "</table>"


def _records_html(report) -> str:
    e = html.escape
    rows = ["<table><tr><th>graph</th><th>pass</th><th>module</th><th>node</th><th>now, or why not</th>"
            "<th>detail</th></tr>"]
    for g in report.graphs:
        for p in g.passes:
            for r in p.rewrites:
                rows.append(f"<tr><td>{g.index}</td><td>{e(p.name)}</td><td>{e(r.module or '<top>')}</td>"
                            f"<td>{e(r.node)}</td><td><code>{e(r.op)}</code></td><td>{e(r.detail)}</td></tr>")
            for s in p.skipped:
                rows.append(f"<tr class='skip'><td>{g.index}</td><td>{e(p.name)}</td><td>{e(s.module or '<top>')}"
                            f"</td><td>{e(s.node)}</td><td>{e(s.reason)}</td><td></td></tr>")
    return "".join(rows) + "</table>"


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
vertical-align:top}th{background:#f0f0f0}tr.skip td,tr.bf16 td{background:#fff8e6}tr.changed td{background:#eef6ff}
tr.unaccounted td,.bad{background:#ffe0e0;color:#900}tr.not_weight td{color:#666}
.coverage{background:#e6f4ea;border:2px solid #2e7d32;border-radius:6px;padding:.5em 1.2em;margin:1em 0}
.coverage .share{font-size:2.4em;font-weight:bold;color:#1b5e20}.coverage table{background:#fff}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px}.add{color:#070;background:#e6ffe6}
.del{color:#900;background:#ffe6e6}.ctx{color:#555}summary{cursor:pointer;margin:.5em 0;font-weight:bold}"""
