"""A bincount's data-dependent length, proven equal to its minlength when its ids are provably below it.

`torch.bincount(ids, minlength=E)` has max(E, max(ids) + 1) entries, so Dynamo gives it an unbacked length
u0 >= E. When the ids provably lie in [0, E) (moepass.analysis.bounded_ids: top-k indices over E experts, ...),
u0 == E. `pin` tells the shape environment so, as `torch._check(counts.size(0) == E)` in the model would: later
reads of the graph's sizes (the EP analysis, AOTAutograd's retrace, Inductor) see E, and Inductor asserts it where
the bincount runs. The deepep rewrite also puts the check in the graph itself (passes/deepep.py), so the rewritten
graph asserts at run time what the analysis proved, eager or compiled.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from moepass.analysis.graph import ancestors, graph_order, node_arg, static_int, tensor_meta
from .bounded_ids import ids_bound
from .graph import op_short_name
from .dtensors import local_value


@dataclasses.dataclass(frozen=True)
class BincountLength:
    bincount: fx.Node
    size: torch.SymInt  # its length as traced (unbacked)
    length: int | None  # the length proven (its minlength), or None
    why: str  # how the ids are bounded, or why the length is not proven

    def describe(self) -> str:
        return f"bincount `{self.bincount.name}` has {self.length} entries (its ids are {self.why})"


def bincount_lengths(node: fx.Node, stop: set[fx.Node]) -> list[BincountLength]:
    """The bincounts upstream of `node` (the walk stops at `stop`) whose data-dependent lengths `node`'s shape
    carries, each with its length proven or the reason it is not. Empty when its shape is static or its
    unbacked sizes come from something other than a bincount."""
    t = local_value(tensor_meta(node))
    wanted = set() if t is None else free_unbacked_symbols(t.shape)
    found, order = [], graph_order(node.graph)
    for n in sorted(ancestors(node, stop) | {node}, key=order.__getitem__):
        b = local_value(tensor_meta(n))
        if op_short_name(n) == "bincount" and b is not None and b.dim() == 1 \
                and free_unbacked_symbols(b.shape[0]) & wanted:
            found.append(_length(n, b.shape[0]))
    return found


def _length(bincount: fx.Node, size) -> BincountLength:
    ids, minlength = bincount.args[0], node_arg(bincount, 2, "minlength", 0)
    minlength = static_int(minlength) if isinstance(minlength, (int, torch.SymInt)) else None
    if not minlength:
        return BincountLength(bincount, size, None, "bincount without a minlength has max(ids) + 1 entries")
    bound = ids_bound(ids)
    if bound.limit is None:
        return BincountLength(bincount, size, None, f"its ids are not provably < {minlength} (they come from "
                                                    f"{bound.how})")
    if bound.limit > minlength:
        return BincountLength(bincount, size, None, f"its ids are < {bound.limit} ({bound.how}), not provably < "
                                                    f"{minlength}")
    return BincountLength(bincount, size, minlength, f"< {bound.limit}: {bound.how}")


def pin(length: BincountLength) -> None:
    """Tell the shape environment the proven length (a deferred runtime assert plus a replacement, as
    `torch._check(size == length)` does). Raises if the length was not proven."""
    if length.length is None:
        raise ValueError(f"the length of bincount `{length.bincount.name}` is not proven: {length.why}")
    torch._check(length.size == length.length, lambda: length.describe())
