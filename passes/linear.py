"""linear (old name: mxfp8_linear): BF16 linears -> moepass::mxfp8_linear or moepass::fp8_rowwise_linear
(all three GEMMs in FP8).

The `recipe` option picks the op per node (moepass.recipes; "auto": recipes.auto): MXFP8 on sm_100 and on CPU, FP8
rowwise on sm_89/sm_90 where it measured faster than BF16, BF16 (node left alone, with the reason) elsewhere.
Matches `F.linear(x, W, b)` (what nn.Linear traces to) and the equivalent `x @ W.t()` /
`torch.matmul(x, W.transpose(0, 1))` on a 2-D parameter. By default the MoE router gate (a
linear whose output feeds top-k selection) and the output head (the last GEMM, whose output is
never added back into a residual stream) stay BF16, as in the MXFP8 recipes that trained at scale.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_or_false

from moepass.analysis.scopes import Scope, dataflow, graph_scopes
from moepass.analysis.sharded_gemm import sharded_gemm
from moepass.graph import (example_value, is_gemm, is_linear, is_matmul, module_path, node_arg, reaches,
                           tensor_meta)
from moepass.gemm_rules import dtype_problem, module_filter_problem
from moepass.recipes.plan import apply_plan, plan_gemm
from moepass.skips import Reason, SkipCode

NAME = "linear"
SUMMARY = ("BF16 linears (F.linear, x @ W.T) -> moepass::mxfp8_linear or fp8_rowwise_linear (per the recipe); "
           "router gate and output head stay BF16")
log = logging.getLogger(__name__)

# ops that pick experts: the router is the linear whose scores reach one of these before any GEMM
_ALWAYS_SELECTING = {"topk", "argsort", "argmax", "argmin", "nonzero", "argwhere", "multinomial"}
_SELECTING_WITH_INDICES = {"max", "min", "sort", "kthvalue", "mode"}  # when their indices output is used
_ADD = {operator.add, operator.iadd, torch.add}
_TRANSPOSES = {"t", "transpose", "permute", "T"}


@dataclasses.dataclass
class LinearMatch:
    node: fx.Node
    x: fx.Node
    weight: fx.Node  # the [N, K] weight node (already un-transposed for matmul forms)
    bias: fx.Node | None
    module: str
    role: str | None  # "router", "output_head" or None
    scope: Scope  # the graph holding the node: the top graph or a HOP body (activation checkpoint, ...)


def _untransposed_weight(node) -> fx.Node | None:
    """For `W.t()` / `W.transpose(0,1)` / `W.T` of a 2-D tensor, return W."""
    if not isinstance(node, fx.Node):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_function" and node.target is getattr and node.args[1] == "T":
        name = "T"
    if name not in _TRANSPOSES:
        return None
    w = node.args[0]
    t = tensor_meta(w)
    if t is None or t.dim() != 2:
        return None
    if name == "transpose" and sorted(d % 2 for d in node.args[1:3]) != [0, 1]:
        return None
    if name == "permute" and tuple(d % 2 for d in (node.args[1:] if len(node.args) > 2 else node.args[1])) != (1, 0):
        return None
    return w


def _op_short_name(n: fx.Node) -> str | None:
    if n.op == "call_method":
        return n.target
    if n.op == "call_function":
        name = getattr(n.target, "__name__", None) or getattr(n.target, "_opname", None)
        return name.split(".")[0] if isinstance(name, str) else None
    return None


def _selects_experts(n: fx.Node) -> bool:
    """top-k, arg-max, sort indices, threshold masks turned into indices (PhiMoE's sparsemixer uses max)."""
    name = _op_short_name(n)
    if name in _ALWAYS_SELECTING:
        return True
    if name in _SELECTING_WITH_INDICES:
        return any(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1 for u in n.users)
    return False


def _is_residual_add(n: fx.Node, numel: int) -> bool:
    """An add into the residual stream: at least the linear's size, or two same-shaped tensors (sequence
    parallelism reduce-scatters a rowwise linear's output to 1/tp of its size before the residual add)."""
    is_add = (n.op == "call_function" and n.target in _ADD) or (n.op == "call_method" and n.target in ("add", "add_"))
    v = example_value(n)
    if not is_add or not isinstance(v, torch.Tensor):
        return False
    # numel may be unbacked (a linear on a torch.split chunk of .tolist() sizes): never guard on it
    operands = [tensor_meta(a) for a in n.args[:2]]
    same_shaped = all(o is not None and o.dim() == v.dim() for o in operands) and all(
        guard_or_false(a == b) for a, b in zip(operands[0].shape, operands[1].shape))
    return same_shaped or guard_or_false(v.numel() >= numel)


def _role(g, node: fx.Node, top: fx.Graph) -> str | None:
    downstream = reaches(g, node, stop_at=is_gemm)
    if any(_selects_experts(n) for n in downstream):
        return "router"
    out = example_value(node)
    numel = out.numel() if isinstance(out, torch.Tensor) else 0
    # a body output the data flow does not follow (an autograd.Function's) may reach anything
    leaves_unfollowed = any(n.op == "output" and n.graph is not top and not list(g.successors(n)) for n in downstream)
    if not leaves_unfollowed and not any(is_gemm(n) or _is_residual_add(n, numel) for n in downstream):
        return "output_head"
    return None


def find_linears(gm: fx.GraphModule) -> list[LinearMatch]:
    """Every linear-shaped GEMM in the graph and its HOP bodies, with its role. Pure: does not touch the graph."""
    scopes = graph_scopes(gm)
    g = dataflow(scopes)
    return [m for scope in scopes for m in _scope_linears(scope, g, gm.graph)]


def _scope_linears(scope: Scope, g, top: fx.Graph) -> list[LinearMatch]:
    matches = []
    for node in scope.graph.nodes:
        if is_linear(node):
            x, w, b = node.args[0], node_arg(node, 1, "weight"), node_arg(node, 2, "bias")
        elif is_matmul(node) and len(node.args) == 2:
            x, w, b = node.args[0], _untransposed_weight(node.args[1]), None
            if w is None:
                continue  # activation @ activation (e.g. attention scores): not a linear
        else:
            continue
        matches.append(LinearMatch(node, x, w, b, module_path(node), _role(g, node, top), scope))
    return matches


def _problem(m: LinearMatch, config) -> Reason | None:
    if m.role == "router" and config["lowp.keep_router_bf16"]:
        return Reason(SkipCode.ROUTER_GATE, "router gate: its output feeds expert selection (top-k, arg-max, sort) "
                                            "(kept BF16; lowp.keep_router_bf16)")
    if m.role == "output_head" and config["lowp.keep_output_head_bf16"]:
        return Reason(SkipCode.OUTPUT_HEAD, "output head (vocabulary projection): no GEMM or residual add after it in "
                                            "this graph (also the last GEMM before a graph break looks so) (kept BF16; "
                                            "lowp.keep_output_head_bf16)")
    problem = module_filter_problem(m.module, config)
    if problem:
        return problem
    x, w = tensor_meta(m.x), tensor_meta(m.weight)
    problem = dtype_problem(activation=x, weight=w) or (
        dtype_problem(bias=tensor_meta(m.bias)) if isinstance(m.bias, fx.Node) else None)
    if problem:
        return problem
    if w.dim() != 2 or x.dim() < 2:
        return Reason(SkipCode.NOT_2D_WEIGHT, f"weight is {w.dim()}-D and activation {x.dim()}-D; expected a 2-D "
                                              "weight and >= 2-D activation")
    return None


def run(gm: fx.GraphModule, example_inputs, config, record) -> None:
    for m in find_linears(gm):
        with record.in_scope(m.scope):
            _rewrite(m, config, record)
    log.debug("linear: %d rewritten, %d skipped", len(record.rewrites), len(record.skipped))


def _rewrite(m: LinearMatch, config, record) -> None:
    # the activation as the node holds it now: an earlier rewrite may have replaced it (a linear fed straight
    # from another, `b(a(x))`), and the match recorded the node it replaced
    m = dataclasses.replace(m, x=m.node.args[0])
    problem = _problem(m, config)
    sharded = sharded_gemm("linear", [m.x, m.weight, m.bias]) if not problem else None
    if problem or isinstance(sharded, Reason):
        record.skip(m.node, m.module, problem or sharded)
        return
    x = tensor_meta(m.x)
    # under tensor parallelism each rank runs the GEMM on its shards: plan (alignment, speed) on their sizes
    x_shape, (n, k) = (x.shape, tensor_meta(m.weight).shape) if sharded is None else sharded.local_shapes[:2]
    plan = plan_gemm(config, "linear", x.device, math.prod(x_shape[:-1]), k, n)
    shards = "" if sharded is None else f" per shard ({sharded.layout})"
    if isinstance(plan, Reason) and shards:
        plan = plan.plus(f" [K and N{shards}]")
    apply_plan(record, m.scope.graph, m.node, m.module, plan, (m.x, m.weight, m.bias), f"K={k} N={n}{shards}")
