"""What the passes did: per pass, per graph, with reasons for every node left alone.

A `Report` collects one `GraphRecord` per graph the backend compiled, each tagged with the torch.compile
call it came from (torchtitan compiles every block, and the loss, in a call of its own). `to_dict()` is the
stable schema docs/inspection.md describes (totals over the graphs); `index()` is one line per graph and the totals per
pass; `save(dir)` writes both, each graph's own report and its code before and after each pass (report/files.py).
Each graph also holds every GEMM left in it and what became of it (moepass.report.coverage): the coverage, per graph and
in total, is in all of these, with identical layers folded into one line (moepass.report.collapse).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter

from . import collapse, coverage
from .coverage import GemmUse
from ..skips import Reason, SkipCode

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
    code: SkipCode | None = None  # why and fix (moepass.report.left_alone.explain); not in to_dict's schema

    def to_dict(self) -> dict:
        return {"node": self.node, "module": self.module, "reason": self.reason}


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

    def skip(self, node, module: str, reason: Reason) -> None:
        self.skipped.append(Skip(self._name(node), module, reason.text, reason.code))


@dataclasses.dataclass(frozen=True, eq=False)
class GraphOrigin:
    """Where a graph came from: its torch.compile call, that call's options, and what Dynamo traced."""
    call: object = None  # torch's per-call backend wrapper (compared by identity); None when unknown
    config: dict = dataclasses.field(default_factory=dict)  # the call's options (Config.to_dict()); {}: unknown
    compile_id: str = ""  # Dynamo's "<frame>/<recompile>": "0/1" is frame 0's second graph (another block)
    frame: str = ""  # the function Dynamo traced: "forward (deepseek_v3.py:33)"


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
    origin: GraphOrigin = dataclasses.field(default_factory=GraphOrigin)
    compile_call: int = 0  # which of its report's torch.compile calls (numbered in the order first seen)
    weights_sharded: bool = False  # its GEMMs' weights are gathered by FSDP2 for the step (analysis.fsdp)
    gemms: list[GemmUse] = dataclasses.field(default_factory=list)  # every GEMM left in it (moepass.report.coverage)

    @property
    def module(self) -> str:
        """The deepest module holding every node a pass rewrote or left alone ("layers.1"; "" if none or the
        whole model)."""
        paths = [r.module.split(".") for p in self.passes for r in (*p.rewrites, *p.skipped) if r.module]
        return ".".join(os.path.commonprefix(paths)) if paths else ""

    def line(self) -> dict:
        """This graph's line of the index: where it came from and what each pass did to it."""
        return {"graph": self.index, "compile_call": self.compile_call, "compile_id": self.origin.compile_id,
                "frame": self.origin.frame, "module": self.module, "replayed": self.replayed,
                "replaced": {p.name: len(p.rewrites) for p in self.passes},
                "skipped": {p.name: len(p.skipped) for p in self.passes},
                "compiled": [c["kind"] for c in self.compiled], "weights_sharded_by_fsdp": self.weights_sharded,
                "coverage": self.coverage(), "files": f"graphs/{self.index}"}

    def coverage(self) -> dict:
        return coverage.coverage(self.gemms, [self.index] * len(self.gemms))

    def where(self) -> str:
        return self.module or self.origin.frame or f"graph {self.index}"


class Report:
    def __init__(self, config: dict | None = None):
        self.config = config or {}
        self.graphs: list[GraphRecord] = []
        self.graph_breaks = 0
        self.frames_eager = 0  # frames Dynamo gave up on: run in eager, never rewritten (collect.dynamo_counts)
        # id of a backend's record -> (that record, held so that its id stays its own; this report's copy)
        self._sources: dict[int, tuple[GraphRecord, GraphRecord]] = {}
        self._calls: list[object] = []  # the torch.compile calls seen, in order (GraphOrigin.call)
        self._next_origin = GraphOrigin()  # where the graph added next comes from (collect.current_report)
        self.saved_dirs: set[str] = set()  # directories this report has written in full (files.save)

    def expect(self, origin: GraphOrigin) -> None:
        """Say where the next graph `add_graph` gets comes from (its compile call, options and frame)."""
        self._next_origin = origin

    def add_graph(self, record: GraphRecord, replayed: bool = False) -> GraphRecord:
        """Hold one compiled graph's record (a copy: its index is this report's) and return the copy. A graph
        Dynamo serves from its cache is added when it runs (`replayed`), once, with the origin it was compiled
        with."""
        if id(record) in self._sources:
            return self._sources[id(record)][1]
        if not replayed and not record.origin.config:
            record.origin = self._next_origin  # on the backend's record too: a later replay keeps its origin
        if not any(call is record.origin.call for call in self._calls):
            self._calls.append(record.origin.call)
        call = next(i for i, c in enumerate(self._calls) if c is record.origin.call)
        held = dataclasses.replace(record, index=len(self.graphs), replayed=replayed, compile_call=call)
        self._sources[id(record)] = (record, held)
        self.graphs.append(held)
        return held

    @property
    def compile_calls(self) -> int:
        return len(self._calls)

    @property
    def compiled(self) -> list[dict]:
        """The post-grad graphs Inductor compiled from this report's graphs (forward, then backward when run),
        each with the index of the graph it came from."""
        return [{**c, "graph": g.index} for g in self.graphs for c in g.compiled]

    @property
    def replayed(self) -> int:
        return sum(g.replayed for g in self.graphs)

    def report_dirs(self) -> list[str]:
        """The `report_dir`s its compile calls named, in order: each shows every graph of the report."""
        dirs = [g.origin.config.get("report_dir") for g in self.graphs]
        return list(dict.fromkeys(d for d in dirs if d))

    def only(self, graph: GraphRecord) -> Report:
        """A report of one of this report's graphs (keeping its index): that graph's own report."""
        single = Report(graph.origin.config or self.config)
        single.graphs, single._calls = [graph], [graph.origin.call]
        return single

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

    def coverage(self) -> dict:
        """GEMMs found, low precision, BF16 by reason, unaccounted, and the low-precision share of FLOPs, over every
        graph (moepass.report.coverage.coverage)."""
        return coverage.coverage([u for g in self.graphs for u in g.gemms],
                                 [g.index for g in self.graphs for _ in g.gemms])

    def folded_gemms(self) -> list[collapse.Folded]:
        """Every GEMM of every graph, identical layers folded into one line each."""
        return collapse.fold_gemms([u for g in self.graphs for u in g.gemms])

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
                    "skipped": [s.to_dict() for s in p.skipped],
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
            "compile_calls": self.compile_calls,
            "per_graph": [g.line() for g in self.graphs],
            "coverage": self.coverage(),
            "gemms": [{"graph": g.index, **u.to_dict()} for g in self.graphs for u in g.gemms],
        }

    def index(self) -> dict:
        """Totals per pass (replaced and skipped counts, summed over the graphs), one line per graph, and the
        graphs of each torch.compile call with the options where they differ from the report's."""
        calls = []
        for i, call in enumerate(self._calls):
            graphs = [g for g in self.graphs if g.compile_call == i]
            config = graphs[0].origin.config if graphs else {}
            calls.append({"compile_call": i, "graphs": [g.index for g in graphs],
                          "options_differing": {k: v for k, v in config.items() if self.config.get(k) != v}})
        return {
            "schema_version": SCHEMA_VERSION,
            "totals": {p.name: {"replaced": len(p.rewrites), "skipped": len(p.skipped)} for p in self.pass_totals()},
            "graphs": [g.line() for g in self.graphs],
            "compile_calls": calls,
            "graph_breaks": self.graph_breaks,
            "frames_run_eagerly": self.frames_eager,
            "replayed_graphs": self.replayed,
            "coverage": self.coverage(),
            "gemms_folded": [f.to_dict() for f in self.folded_gemms()],
        }

    def summary(self, max_graphs: int = 20, max_lines: int = 20) -> str:
        """A terminal table: the coverage, one row per pass (totals), one row per graph when there are several,
        what each GEMM became and every skip with its reason, identical layers folded (at most `max_lines` each)."""
        replayed = (f" ({self.replayed} served from Dynamo's cache, compiled before this report began; their "
                    "graph breaks were counted then)") if self.replayed else ""
        calls = f", {self.compile_calls} torch.compile calls" if self.compile_calls > 1 else ""
        lines = [f"moepass: {len(self.graphs)} graph(s), {self.graph_breaks} graph break(s){calls}{replayed}"]
        if self.frames_eager:
            lines.append(f"warning: {self.frames_eager} frame(s) fell back to eager (graph breaks Dynamo could not "
                         "split at: inside an activation-checkpointed layer, in a loop); the GEMMs they run "
                         "themselves never reach moepass and stay BF16 (TORCH_LOGS=graph_breaks says where)")
        if self.graphs:
            cov = self.coverage()
            lines.append(f"coverage: {coverage.coverage_line(cov)}")
            lines += _at_most([f"  UNACCOUNTED (a moepass bug: no pass rewrote it or said why): {u['op']} at "
                               f"{u['module'] or '<top>'} (graph {u['graph']}, node {u['node']})"
                               for u in cov["unaccounted_gemms"]], max_lines)
        lines.append(f"{'pass':<19} {'replaced':>8} {'skipped':>8} {'ms':>8}  implementation")
        for p in self.pass_totals():
            impl = "; ".join(f"{k}: {v}" for k, v in p.implementations.items()) or "-"
            lines.append(f"{p.name:<19} {len(p.rewrites):>8} {len(p.skipped):>8} {p.ms:>8.1f}  {impl}")
        lines += self._inside_inductor()
        if len(self.graphs) > 1:
            lines += self._graph_rows(max_graphs)
        folded = self.folded_gemms()
        if folded:
            lines.append("GEMMs (identical layers folded):")
            lines += _at_most([f"  {f.line()}" for f in folded], max_lines)
        skips = collapse.fold_records([(p.name, s) for p in self.pass_totals() for s in p.skipped],
                                      lambda s: s.reason)
        if skips:
            lines.append("skipped (left in BF16 / unchanged):")
            # a module skipped for one reason at several nodes (an expert block's w1, w3, w2) is named once
            lines += _at_most([f"  [{name}] {f.modules or '<top>'}{f' (x{f.nodes})' if f.nodes > 1 else ''}: "
                               f"{f.outcome}" for name, f in skips], max_lines)
        return "\n".join(lines)

    def _inside_inductor(self) -> list[str]:
        """What moepass rewrote inside Inductor, from the compiled graphs' audit (inductor_stage/segment_sums.py)."""
        lines = []
        for op, what, option in (("segment_sum_rows", "segment sums", "segment_sums.devices"),
                                 ("permutation_gather_sum", "gather-sums along a routing permutation",
                                  "segment_sums.permutations")):
            sums = {kind: sum(c["ops"].get(f"moepass.{op}", 0) for c in self.compiled if c["kind"] == kind)
                    for kind in ("forward", "backward")}
            if any(sums.values()):
                lines.append(f"inside Inductor: {sum(sums.values())} scatter-add(s) of rows as {what} "
                             f"({sums['forward']} forward, {sums['backward']} backward; option {option})")
        return lines

    def _graph_rows(self, max_graphs: int) -> list[str]:
        width = min(40, max(len(g.where()) for g in self.graphs))
        rows = [f"{'graph':>5} {'call':>4}  {'where':<{width}}  {'skipped':>7}  {'lowp':>6}  "
                "replaced; compiled by Inductor"]
        for g in self.graphs[:max_graphs]:
            replaced = ", ".join(f"{p.name} {len(p.rewrites)}" for p in g.passes if p.rewrites) or "nothing"
            compiled = "+".join(c["kind"] for c in g.compiled) or "-"
            share = g.coverage()["low_precision_flop_share"]
            skipped = sum(len(p.skipped) for p in g.passes)
            rows.append(f"{g.index:>5} {g.compile_call:>4}  {g.where()[:width]:<{width}}  "
                        f"{skipped:>7}  {coverage.share_text(share):>6}  {replaced}; {compiled}")
        if len(self.graphs) > max_graphs:
            rows.append(f"  ... and {len(self.graphs) - max_graphs} more graph(s): Report.index() or index.json "
                        "in report_dir lists every one")
        return rows

    def save(self, directory: str, changed: list[GraphRecord] | None = None) -> str:
        """Write report.json (totals), index.json, report.html and each graph's own report (graphs/<i>/) and
        code (graph_<i>_<stage>.py); return the HTML path. `changed`: only these graphs' files are rewritten
        where this report saved every graph before (the totals always are)."""
        from .files import save

        return save(self, directory, changed)

    def to_html(self) -> str:
        from .files import report_page

        return report_page(self)


def _at_most(lines: list[str], limit: int) -> list[str]:
    if len(lines) <= limit:
        return lines
    return lines[:limit] + [f"  ... and {len(lines) - limit} more (report.html, index.json)"]
