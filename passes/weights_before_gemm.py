"""weights_before_gemm: `G(h, W) * w[:, None]` -> `G(h * w[:, None], W)`: the routing weights scale the experts' down
projection input instead of its output.

Every DeepSeek-style MoE weights each routed row by its router score after the experts: torchtitan's
`(routed_output.float() * scores.reshape(-1, 1)).to(bf16)`, transformers' `proj_out * sample_weights.unsqueeze(-1)`,
DeepSeek's `expert(x) * weights[idx, top, None]`. The backward of that product needs the experts' output for the
weights' gradient, so every step keeps it: [N, D] BF16 rows, the largest activation of an MoE layer (1.9 GB a layer
at 671B dims, 4,096 x 4 tokens). A row scale commutes with a GEMM over rows (and with any grouping of rows), so the
weight moves onto the down projection's input, [N, F] with F = moe_inter_dim, 3.5x narrower at 671B dims. Its
backward reads h, which the SwiGLU recomputes from what it saves anyway, and nothing [N, D] is kept. The multiply and
the weights' gradient also run F wide instead of D wide.

Numerics: the product is computed in the dtype the model asked for (fp32 in torchtitan) and rounded once to the
GEMM's input dtype, where the original rounded the GEMM's output before weighting: one BF16 rounding moves from the
output to the input. Under an FP8 recipe the quantization that follows absorbs it (a per-row or per-tile scale takes
the weight: the same FP8 codes).

Matches a bias-free linear, a grouped GEMM or a row-preserving matmul whose output, through float casts only, is
multiplied by a per-row column `[..., M, 1]` not computed from it. A GEMM whose output is read elsewhere too (the
product would not drop it), with a bias (the weight would scale it), or on DTensors is left alone with the reason.
Runs before grouped_mm and linear, on torch's ops: they then rewrite the moved GEMM as any other.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from moepass.analysis import autocast
from moepass.analysis.dtensors import is_dtensor
from moepass.analysis.scopes import graph_scopes
from moepass.analysis.torchao_converted import left_to_torchao
from moepass.analysis.emit import Emitter, fake_value
from moepass.analysis.graph import ancestors, is_grouped_mm, is_linear, is_matmul, is_mul, node_arg, tensor_meta
from moepass.analysis.node_module import module_path
from moepass.skips import Reason, SkipCode

NAME = "weights_before_gemm"

log = logging.getLogger(__name__)

_CASTS = {"to", "float", "bfloat16", "half", "double", "type_as"}  # value-keeping up to rounding, rows unchanged
_PROVENANCE = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")


def run(gm: fx.GraphModule, config, record) -> None:
    for scope in graph_scopes(gm):
        with record.in_scope(scope):
            for node in list(scope.graph.nodes):
                found = _weighted_output(node)
                if found is None:
                    continue
                chain, mul, weight = found
                problem = left_to_torchao(node, config) or _problem(node, chain, mul)  # torchao's numerics stay
                if problem is not None:
                    record.skip(node, module_path(node), problem)
                    continue
                x, out = tensor_meta(_gemm_input(node)), tensor_meta(node)
                detail = f"{weight.name} scales the {list(x.shape)} input, not the {list(out.shape)} output"
                before = set(scope.graph.nodes)
                try:
                    with autocast.replay(node, scope):  # the GEMM's copy runs in the autocast region it ran in
                        _move_weight(scope.graph, node, chain, mul, weight)
                except Exception as error:  # a moepass problem never fails the user's compile
                    log.warning("weights_before_gemm: left %s alone: %r", node.name, error, exc_info=True)
                    for added in reversed([n for n in scope.graph.nodes if n not in before]):
                        if not added.users:  # what it added before failing (it rewires the product last)
                            scope.graph.erase_node(added)
                    record.skip(node, module_path(node), Reason(SkipCode.REWRITE_ERROR,
                                                                f"could not rewrite: {error!r}"))
                    continue
                record.replace(node, module_path(node), "weight before the GEMM", detail)


def _gemm_input(node: fx.Node):
    return node_arg(node, 0, "input", node_arg(node, 0, "self"))


def _row_gemm(node: fx.Node) -> bool:
    """A GEMM whose output row i is a product of input row i alone (so a row scale commutes with it)."""
    x, out = tensor_meta(_gemm_input(node)), tensor_meta(node)
    if x is None or out is None or x.dim() < 2 or tuple(x.shape[:-1]) != tuple(out.shape[:-1]):
        return False
    if is_grouped_mm(node):
        return x.dim() == 2 and node_arg(node, 2, "offs") is not None
    return is_linear(node) or is_matmul(node)


def _weighted_output(node: fx.Node):
    """(casts, mul, weight) when `node` is a row GEMM whose output, through float casts alone, is multiplied by a
    per-row column not computed from it; else None."""
    if not (is_linear(node) or is_matmul(node) or is_grouped_mm(node)) or not isinstance(_gemm_input(node), fx.Node) \
            or not _row_gemm(node):
        return None
    chain, value = [], node
    while len(value.users) == 1:
        (user,) = value.users
        if _is_cast(user, value):
            chain.append(user)
            value = user
            continue
        if not is_mul(user):
            return None
        others = [a for a in (*user.args, *user.kwargs.values()) if a is not value]
        if len(others) != 1 or len(user.args) + len(user.kwargs) != 2 or not isinstance(others[0], fx.Node):
            return None
        weight, out, w = others[0], tensor_meta(value), tensor_meta(others[0])
        if w is None or out is None or not w.dtype.is_floating_point or w.dim() != out.dim() \
                or tuple(w.shape) != (*out.shape[:-1], 1) or node in ancestors(weight):
            return None
        return chain, user, weight
    if len(value.users) > 1 and any(is_mul(u) and _row_column(u, value, node) for u in value.users):
        return chain, None, None  # weighted, but the output is read elsewhere too: _problem says so
    return None


def _row_column(mul: fx.Node, value: fx.Node, gemm: fx.Node) -> bool:
    others = [a for a in mul.args if a is not value]
    out = tensor_meta(value)
    w = tensor_meta(others[0]) if len(others) == 1 and isinstance(others[0], fx.Node) else None
    return w is not None and out is not None and w.dim() == out.dim() and tuple(w.shape) == (*out.shape[:-1], 1) \
        and gemm not in ancestors(others[0])


def _is_cast(node: fx.Node, source: fx.Node) -> bool:
    if node.op != "call_method" or node.target not in _CASTS or node.args[0] is not source:
        return False
    src, out = tensor_meta(source), tensor_meta(node)
    if src is None or out is None or not out.dtype.is_floating_point or tuple(src.shape) != tuple(out.shape):
        return False
    # `.to(dtype)` only: a device move or a memory-format change is not a cast of these rows
    return node.target != "to" or all(isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values()))


def _problem(node: fx.Node, chain, mul) -> Reason | None:
    if mul is None:
        read = chain[-1] if chain else node
        return Reason(SkipCode.OUTPUT_READ_ELSEWHERE, f"the unweighted output is also read by "
                      f"{', '.join(u.name for u in read.users if not is_mul(u)) or 'more than one product'}")
    bias = node_arg(node, 2, "bias") if is_linear(node) else node_arg(node, 3, "bias") if is_grouped_mm(node) else None
    if bias is not None:
        return Reason(SkipCode.WEIGHT_WITH_BIAS, "the GEMM has a bias, which the weight would scale too")
    values = [tensor_meta(_gemm_input(node)), tensor_meta(mul)]
    if any(v is not None and is_dtensor(v) for v in values):
        return Reason(SkipCode.WEIGHT_ON_DTENSORS, "the operands are DTensors (tensor parallelism): the weight stays "
                                                   "on the output")
    if any(v is None for v in values):
        return Reason(SkipCode.NO_METADATA, "operands have no recorded tensor metadata")
    return None


def _move_weight(graph: fx.Graph, gemm: fx.Node, chain: list[fx.Node], mul: fx.Node, weight: fx.Node) -> None:
    """h -> (h.to(p) * w).to(h.dtype) before a copy of the GEMM, p the dtype the model's product had; the product's
    users read the new GEMM's output cast to p. Inserted at the product: w may be computed after the GEMM."""
    h = _gemm_input(gemm)
    h_dtype, product_dtype = tensor_meta(h).dtype, tensor_meta(mul).dtype
    emit = Emitter(graph, getattr(tensor_meta(h), "fake_mode", None))
    with graph.inserting_before(mul):
        wide = h if h_dtype == product_dtype else emit("to", h, product_dtype, method=True)
        weighted = emit(operator.mul, wide, weight)
        if product_dtype != h_dtype:
            weighted = emit("to", weighted, h_dtype, method=True)
        args, kwargs = list(gemm.args), dict(gemm.kwargs)
        if args:
            args[0] = weighted
        else:
            kwargs["input" if "input" in kwargs else "self"] = weighted
        moved = graph.create_node(gemm.op, gemm.target, tuple(args), kwargs)
        for key in _PROVENANCE:  # module paths: the GEMM passes filter on them and report by them
            if key in gemm.meta:
                moved.meta[key] = gemm.meta[key]
        moved.meta["moepass_replaced"] = gemm.name
        fake_value(moved, emit.fake_mode)
        out = moved if tensor_meta(moved).dtype == product_dtype else emit("to", moved, product_dtype, method=True)
    for new in (wide, weighted, out):
        if new is not h and "nn_module_stack" in gemm.meta:
            new.meta.setdefault("nn_module_stack", gemm.meta["nn_module_stack"])
    mul.replace_all_uses_with(out)
    graph.erase_node(mul)
    for node in reversed(chain):
        graph.erase_node(node)
    graph.erase_node(gemm)
