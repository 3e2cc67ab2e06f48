"""An expert-parallel region's parts: what the finder names (moepass.analysis.ep_region) and the candidates the
checks choose among by evaluation (moepass.analysis.ep_checks). Both read these; neither imports the other's."""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from moepass.analysis.graph import ancestors, between, graph_order, static_shape, tensor_meta, written_buffer
from moepass.skips import SkipCode

from .collectives import AllToAll
from .symbols import same, size_expr

INDEX_DTYPES = (torch.int64, torch.int32)
# row tensors before the combine tried as the experts' output, latest first (most fail fast: not computable from one)
_MAX_EXPERT_OUTPUT_CANDIDATES = 64


@dataclasses.dataclass
class EPRegion:
    """One dispatch + combine region, with what the DeepEP rewrite needs."""

    module: str
    counts_a2a: AllToAll
    token_a2a: AllToAll
    combine_a2a: AllToAll
    x: fx.Node  # token rows before routing: T rows of D in all ([T, D] or [B, S, D])
    topk_ids: fx.Node  # global expert ids, [..., K] with T rows in all
    topk_weights: fx.Node | None  # routing weights, shaped like topk_ids
    num_tokens: int  # T as checked: the graph's own, or a small one when T is symbolic (see `symbols`)
    top_k: int
    hidden: int  # D as checked
    num_experts: int
    group_size: int
    group_name: str
    expert_input: fx.Node  # received rows in expert-major order, as the experts read them
    expert_counts: fx.Node | None  # rows per local expert fed to the experts (set by ep_checks; None: one local
    # expert that reads no group sizes)
    expert_output: fx.Node | None  # the experts' output rows, in expert_input's order (set by ep_checks)
    tokens_out: fx.Node | None  # sum over each token's K expert rows (weighted or not), T rows of D
    weights_applied: str = ""  # "before_experts" or "after_experts"
    checked_routings: int = 0
    weights_on_sent_rows: bool = False  # a [T, K] weight tensor reaches the rows sent (read off the graph)
    token_count: object = None  # T as the graph holds it: an int, or an expression of size symbols
    symbols: dict = dataclasses.field(default_factory=dict)  # size symbol -> the value the checks used
    # bincounts whose data-dependent length the analysis proved to be E (counts_length): the rewrite asserts them
    pinned_lengths: list = dataclasses.field(default_factory=list)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.group_size


@dataclasses.dataclass
class RegionSkip:
    node: fx.Node
    module: str
    reason: str
    code: SkipCode


class Mismatch(Exception):
    """The region does not compute what DeepEP's dispatch/combine compute; `reason` says where, `code` which
    documented reason it is (moepass.skips).

    `stage` orders how far the analysis got (naming the parts, then each evaluation check): when several
    readings of a region fail, the reason of the one that got furthest is the one a user can act on."""

    def __init__(self, node: fx.Node, code: SkipCode, reason: str, stage: int = 0):
        super().__init__(reason)
        self.node, self.code, self.reason, self.stage = node, code, reason, stage


def index_meta(node) -> torch.Tensor | None:
    t = tensor_meta(node)
    return t if t is not None and t.dtype in INDEX_DTYPES else None


def sizes_meta(node) -> torch.Tensor | None:
    """Group sizes may be float: transformers feeds torch.histc's output straight into cumsum(dtype=int32)."""
    t = tensor_meta(node)
    return t if t is not None and (t.dtype in INDEX_DTYPES or t.is_floating_point()) else None


def expert_output_candidates(region: EPRegion) -> list[fx.Node]:
    """Row tensors between the experts' input and the rows sent back, latest first: one of them is the
    experts' output that the rows sent back un-permute (ep_checks decides which by evaluation)."""
    comb, expert_input = region.combine_a2a, region.expert_input
    width = size_expr(tensor_meta(comb.input).shape[1])
    received = {region.token_a2a.result, region.counts_a2a.result}
    inner = between({expert_input}, comb.input, stop=received) - {comb.input}
    order = graph_order(comb.node.graph)
    rows = [n for n in inner if (t := tensor_meta(n)) is not None and t.dim() == 2 and t.is_floating_point()
            and same(size_expr(t.shape[1]), width) and written_buffer(n) is None]
    if not rows:
        raise Mismatch(comb.node, SkipCode.ROWS_BACK_NOT_COMPUTED,
                       "the rows sent back are not computed from the expert-major received rows")
    # last, the rows sent back themselves: with one expert per rank the received order is already expert-major
    return sorted(rows, key=order.__getitem__, reverse=True)[:_MAX_EXPERT_OUTPUT_CANDIDATES] + [comb.input]


def expert_counts_candidates(region: EPRegion) -> tuple[list[fx.Node], list[fx.Node]]:
    """([E_local] integer nodes through which the received counts reach the experts, latest first;
    the experts' inputs computed from them). ep_checks picks the one holding the rows per local expert.
    ([], []) for one local expert that reads no group sizes (EP over as many ranks as experts)."""
    tok, counts, expert_input = region.token_a2a, region.counts_a2a, region.expert_input
    received = {tok.result, counts.result}
    expert_nodes = between({expert_input}, region.expert_output, stop=received)
    side = {a for n in expert_nodes - {expert_input} for a in n.all_input_nodes if a not in expert_nodes}
    upstream = {s: ancestors(s, stop=received) | {s} for s in side}
    if any(tok.result in up for up in upstream.values()):
        raise Mismatch(tok.node, SkipCode.READS_RECEIVED_ROWS,
                       "the experts read the received rows other than through the expert-major rows")
    from_counts = [s for s in side if counts.result in upstream[s]]
    if not from_counts and region.num_local_experts == 1:
        return [], []  # one local expert takes every received row as one group: there are no group sizes to supply
    if not from_counts:
        raise Mismatch(tok.node, SkipCode.GROUP_SIZES,
                       "the experts are given no group sizes derived from the received counts")
    candidates = {c for s in from_counts for c in upstream[s]
                  if static_shape(sizes_meta(c)) == (region.num_local_experts,)
                  and counts.result in ancestors(c, stop=received)}
    order = graph_order(tok.node.graph)
    return sorted(candidates, key=order.__getitem__, reverse=True), from_counts
