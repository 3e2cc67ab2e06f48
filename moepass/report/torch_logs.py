"""moepass in PyTorch's own compile tooling: `TORCH_LOGS` / `torch._logging.set_logs` and `TORCH_TRACE` + tlparse.

- The `moepass` log: every module logs through `logging.getLogger(__name__)` under the `moepass` package, so
  `TORCH_LOGS="+moepass"` (or `torch._logging.set_logs(modules={"moepass": logging.DEBUG})`) shows the pass log
  with torch's own format, beside Dynamo's and Inductor's.
- Structured-trace artifacts: each pass's graph before and after it, and the graph's pass report, emitted from inside
  the compile, so `TORCH_TRACE=dir` then `tlparse dir` lists them under the compile id, next to Dynamo's and
  Inductor's graphs. Nothing is built unless a trace is being written (payloads are callables torch calls only then).
"""

from __future__ import annotations

import dataclasses

from torch._logging import trace_structured
from torch._logging._internal import log_registry, register_log

LOG = "moepass"
ARTIFACT_PREFIX = "moepass_"


def register() -> None:
    """Name moepass's loggers to torch._logging (idempotent; TORCH_LOGS may already have named the package)."""
    if not log_registry.is_log(LOG):
        register_log(LOG, [LOG])


def trace_artifact(name: str, payload_fn, encoding: str = "string") -> None:
    """One structured-trace artifact `moepass_<name>`; `payload_fn` runs only while a trace is written."""
    trace_structured("artifact", metadata_fn=lambda: {"name": ARTIFACT_PREFIX + name, "encoding": encoding},
                     payload_fn=payload_fn)


def trace_pass_graph(pass_name: str, when: str, code_fn) -> None:
    """A pass's graph code `when` ("before" / "after") it ran: artifact `moepass_<pass>_<when>`."""
    trace_artifact(f"{pass_name}_{when}", code_fn)


def pass_report(record) -> dict:
    """What each pass did to one graph (a GraphRecord), as the report's JSON spells a pass."""
    return {
        "passes": [{"name": p.name, "replaced": len(p.rewrites), "skipped": [s.to_dict() for s in p.skipped],
                    "ms": round(p.ms, 3), "rewrites": [dataclasses.asdict(r) for r in p.rewrites],
                    "implementations": p.implementations} for p in record.passes],
        "ops_before": dict(record.ops_before),
        "ops_after": dict(record.ops_after),
        "coverage": record.coverage(),
    }


def trace_graph_report(record) -> None:
    """The graph's pass report: artifact `moepass_report` (JSON)."""
    trace_artifact("report", lambda: pass_report(record), encoding="json")


register()
