"""The model's output head (its vocabulary projection), known by what it is, not by where a graph ends.

A head is a linear at the end of the model: no GEMM or residual add reads its output. Ending one graph does not make
a head: a graph cut at a graph break, a frame Dynamo compiled apart (one expert's forward, one MLP's) or a DDP bucket
ends at an interior linear just the same. An expert's GEMM (`x_e @ W[e]` on a slice of a stacked expert weight) is
never the head, whatever else holds. For any other linear, what makes it the head, any one of (checked in this order):
  - its output feeds the loss (cross_entropy, log_softmax, nll_loss) in the graph;
  - its weight is an embedding's (tied embeddings);
  - N is the vocabulary size: the rows of an embedding of its model (the live model, reached through the weight,
    see moepass.analysis.module_paths; or an embedding lookup in the graph);
  - the model's forward returns its output: the graph is the model's own frame (its weights are read from the
    frame's local as from the top of the model), ended by its return, not by a graph break or a DDP split, and on the
    way there nothing combines it with another GEMM's output (a MoE layer's scatter_add or index_add of the routed
    experts' outputs into the shared expert's, a cat of per-expert outputs): that is a layer's output, not a
    vocabulary's. Alone, this is the weakest sign, and the reason says so.
"""

from __future__ import annotations

import dataclasses

import networkx as nx
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import guard_or_false

from moepass.analysis.graph import tensor_meta
from moepass.analysis.module_paths import WRAPPER_ATTRS, ModuleIndex

from .gemms import Scopes, weight_source
from .graph import is_gemm, op_short_name
from .scopes import hop_name
from .weight_parameter import WeightParameter

_LOSSES = {"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "log_softmax",
           "_log_softmax"}
_EMBEDDING_OPS = {"embedding"}


@dataclasses.dataclass(frozen=True)
class HeadSign:
    why: str  # what shows it is the head (and, where only its position does, that it is unsure), for the reason
    head: bool = True  # False: `why` shows that a linear ending its graph is no head (an expert's, a combined output)


def _is_embedding(module: nn.Module) -> bool:
    """nn.Embedding, or a module named like one holding a 2-D weight (DeepSeek's ParallelEmbedding, Megatron's
    VocabParallelEmbedding); rotary "embeddings" hold no weight."""
    weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
    return isinstance(module, nn.Embedding) or (type(module).__name__.endswith("Embedding")
                                                and weight is not None and weight.dim() == 2)


def _vocabularies(param: WeightParameter, scopes: Scopes) -> list[tuple[str, int]]:
    """(embedding, rows) of the embeddings of the weight's model, and of the embedding lookups in the graph."""
    found = []
    if param.model is not None:
        for path, module in param.model.named_modules():
            if _is_embedding(module):
                path = ".".join(p for p in path.split(".") if p not in WRAPPER_ATTRS)
                found.append((path or type(module).__name__, int(module._parameters["weight"].shape[0])))
    for scope in scopes.entered:
        for n in scope.graph.nodes:
            table = tensor_meta(n.args[1]) if op_short_name(n) in _EMBEDDING_OPS and len(n.args) > 1 else None
            if table is not None and table.dim() == 2 and isinstance(table.shape[0], int):
                found.append((f"the lookup {n.name}", int(table.shape[0])))
    return found


def _tied(param: WeightParameter, index: ModuleIndex, scopes: Scopes) -> str | None:
    """The embedding the weight is shared with, if any."""
    for module, _ in index.holders(param.value) if param.value is not None else ():
        if _is_embedding(module):
            return index.module_path(module) or type(module).__name__
    for scope in scopes.entered:
        for n in scope.graph.nodes:
            if op_short_name(n) in _EMBEDDING_OPS and len(n.args) > 1 and isinstance(n.args[1], fx.Node) \
                    and param.node is not None and weight_source(n.args[1], scopes) is param.node:
                return f"the lookup {n.name}"
    return None


def _returned_by_model(top: fx.GraphModule, downstream: set[fx.Node], param: WeightParameter) -> bool:
    """The graph is the model's whole forward (its frame's local is the top of the model; Dynamo compiled it for
    the frame's return, not a graph break or a DDP split) and the linear's output is among what it returns."""
    reason = getattr(top, "compile_subgraph_reason", None)
    if reason is None or getattr(reason, "graph_break", True):
        return False
    if not any(n.op == "output" and n.graph is top.graph for n in downstream):
        return False
    return param.source is not None and param.source == param.path


def _expert_stack(weight: fx.Node, param: WeightParameter) -> tuple | None:
    """The shape of the stacked expert parameter ([E, K, N]) whose slice the GEMM's 2-D weight is (`x_e @ W[e]`)."""
    stack, w = tensor_meta(param.node) if param.node is not None else None, tensor_meta(weight)
    if stack is None or w is None or stack.dim() < 3 or w.dim() != 2:
        return None
    # one matrix of the stack, read either way round (`W[e]`, `W[e].t()`, `W.transpose(1, 2)[e]`), even where E is 1
    # (one local expert under expert parallelism); a stack reshaped whole into one matrix is no expert
    one = [tuple(stack.shape[-2:]), tuple(stack.shape[-1:-3:-1])]
    return tuple(stack.shape) if any(all(guard_or_false(a == b) for a, b in zip(w.shape, m)) for m in one) else None


def _inputs(g: nx.DiGraph, n: fx.Node) -> list[fx.Node]:
    """What flows into n: a HOP result read from its body's output where the data flow links it, not from every
    operand of the call."""
    preds = list(g.predecessors(n)) if n in g else list(n.all_input_nodes)
    if n.op == "call_function" and n.args and isinstance(n.args[0], fx.Node) and hop_name(n.args[0]) \
            and len(preds) > 1:
        preds = [p for p in preds if p is not n.args[0]]
    return preds


def _after_a_gemm(g: nx.DiGraph, start: fx.Node) -> bool:
    """Some GEMM's output reaches `start` (walking its data flow upstream)."""
    seen, frontier = {start}, [start]
    while frontier:
        n = frontier.pop()
        if is_gemm(n):
            return True
        for p in _inputs(g, n):
            if p not in seen:
                seen.add(p)
                frontier.append(p)
    return False


def _combined(g: nx.DiGraph, node: fx.Node, downstream: set[fx.Node]) -> fx.Node | None:
    """Where the linear's output meets another GEMM's output on its way out (a scatter_add, index_add, cat or
    product with routed experts' outputs); None when it leaves the model alone. Body boundaries (a HOP call, the
    read of its result, placeholders, outputs) pass values on and combine nothing."""
    found = []
    for d in downstream:
        if d.op not in ("call_function", "call_method") or hop_name(d) or (
                d.args and isinstance(d.args[0], fx.Node) and hop_name(d.args[0])):
            continue
        others = [a for a in d.all_input_nodes if a is not node and a not in downstream
                  and tensor_meta(a) is not None]  # sizes read off an activation combine nothing
        if any(_after_a_gemm(g, a) for a in others):
            found.append(d)
    return min(found, key=lambda d: d.name) if found else None


def head_sign(g: nx.DiGraph, node: fx.Node, weight: fx.Node, downstream: set[fx.Node], n, param: WeightParameter,
              top: fx.GraphModule, scopes: Scopes, index: ModuleIndex) -> HeadSign | None:
    """What shows whether a linear `node` on `weight` ending its graph (`downstream`: what its output reaches before
    a GEMM, along the data flow `g`) with N outputs is the model's output head (`head` False: what shows it is
    not); None when nothing does (it then stays eligible)."""
    stack = _expert_stack(weight, param)
    if stack is not None:
        return HeadSign(f"an expert's GEMM (a slice of the stacked expert weight {list(stack)}): never the output "
                        "head", head=False)
    loss = next((op_short_name(u) for u in downstream if op_short_name(u) in _LOSSES), None)
    if loss is not None:
        return HeadSign(f"its output feeds the loss ({loss})")
    tied = _tied(param, index, scopes)
    if tied is not None:
        return HeadSign(f"its weight is the embedding's ({tied}): tied embeddings")
    vocabularies = _vocabularies(param, scopes)
    hit = next((v for v in vocabularies if isinstance(n, int) and v[1] == n), None)
    if hit is not None:
        return HeadSign(f"N={n} is the vocabulary size (the rows of {hit[0]})")
    if _returned_by_model(top, downstream, param):
        held = tensor_meta(param.node)
        if held is not None and held.dim() != 2:
            return HeadSign(f"the model's forward returns its output, but its weight is read from a {held.dim()}-D "
                            "parameter: position alone marks only a plain linear on a 2-D weight the head", head=False)
        combined = _combined(g, node, downstream)
        if combined is not None:
            return HeadSign(f"the model's forward returns its output combined with other GEMMs' outputs (by "
                            f"{op_short_name(combined)} {combined.name}): a layer's output, not a vocabulary "
                            "projection", head=False)
        unsure = (f"N={n} is no embedding's row count ({', '.join(f'{p}: {r}' for p, r in vocabularies)})"
                  if vocabularies else "no embedding or loss in sight to confirm it")
        return HeadSign(f"the model's forward returns its output, the last GEMM of the model; judged by position "
                        f"only: {unsure}")
    return None
