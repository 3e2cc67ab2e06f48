"""How many rows to expect where expert parallelism makes a row count data dependent.

After an EP exchange the experts read the rows this rank *received*: a count known only at run time (an
unbacked SymInt), so a compile-time choice by tokens per expert (recipe="auto") has no number to go on.
Every rank sends its T*K routed rows and the ranks together receive what they sent, so under balanced
routing a rank receives T*K rows on average. That expectation is read off the nearest exchange upstream:
moepass::ep_dispatch's [T, K] expert ids (the deepep pass ran), or the rows an all-to-all sends.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from torch import fx

from moepass.analysis.graph import example_int, static_int, tensor_meta
from moepass.op_registry import is_dispatch
from .collectives import find_all_to_alls
from .scopes import dataflow, graph_scopes


@dataclasses.dataclass(frozen=True)
class ExpectedRows:
    rows: int
    why: str


class RoutedRows:
    """Expected rows of values downstream of an EP exchange, across the HOP bodies of one compiled graph."""

    def __init__(self, gm: fx.GraphModule):
        scopes = graph_scopes(gm)
        self._flow = dataflow(scopes)  # walks continue into and out of activation-checkpointed bodies
        # the rows an all-to-all sends, keyed by the node its received rows appear as
        self._received = {a.result: a for scope in scopes for a in find_all_to_alls(scope.gm)}

    def expected(self, node: fx.Node) -> ExpectedRows | None:
        """The nearest exchange upstream of `node` and the rows this rank sends through it, if any."""
        seen, queue = {node}, deque([node])
        while queue:
            n = queue.popleft()
            found = self._sent_rows(n)
            if found is not None:
                return found
            for p in self._flow.predecessors(n) if n in self._flow else ():
                if p not in seen:
                    seen.add(p)
                    queue.append(p)
        return None

    def _sent_rows(self, n: fx.Node) -> ExpectedRows | None:
        if n.op == "call_function" and is_dispatch(n.target):
            ids = tensor_meta(n.args[1])  # [T, K] expert ids: each token goes to K experts
            slots = None if ids is None else example_int(math.prod(ids.shape))
            if slots is not None:
                return ExpectedRows(slots, f"T*K={slots} routed rows sent by moepass::ep_dispatch ({n.name}), "
                                           "received back on average under balanced routing")
        a2a = self._received.get(n)
        if a2a is not None:
            sent, received = tensor_meta(a2a.input), tensor_meta(a2a.result)
            if sent is not None and received is not None and sent.dim() == 2 \
                    and static_int(received.shape[0]) is None:
                rows = example_int(sent.shape[0])
                if rows is not None:
                    return ExpectedRows(rows, f"{rows} rows sent by the all-to-all {a2a.node.name}, received "
                                              "back on average under balanced routing")
        return None
