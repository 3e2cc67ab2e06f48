"""linear (old name: mxfp8_linear): BF16 linears -> moepass::<recipe>_linear (mxfp8, fp8_rowwise or blockwise; all
three GEMMs in FP8).

The `recipe` option picks the op per node (moepass.recipes; "auto": recipes.auto): MXFP8 on sm_100 and on CPU, FP8
rowwise on sm_89/sm_90 where it measured faster than BF16, BF16 (node left alone, with the reason) elsewhere;
blockwise only on request.
Every GEMM on a parameter is found, however spelled (moepass.analysis.gemm_spellings reads `F.linear`, `x @ W.t()`,
`x @ W` on a [K, N] weight, `x_e @ W[e]` on an expert stack, addmm and two-operand einsums as y = x @ W.T): each is
rewritten, or left alone with its reason (a batched product per head or expert has no low-precision op). By default
the MoE router gate (a linear whose output feeds top-k selection) and the output head (moepass.analysis.output_head:
known by the vocabulary, tied weights, the loss, or the model's return) stay BF16, as in the MXFP8 recipes that
trained at scale.
A linear runs in BF16 when its operands are BF16 or when a BF16 autocast region casts them (FP32 master weights:
moepass.analysis.autocast): the op then takes the FP32 weight itself, and the activation and bias cast as autocast
casts them (moepass.analysis.bf16_operands).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import guard_or_false

from moepass.analysis import module_paths
from moepass.analysis.gemm_spellings import KN, NK, parameter_gemm
from moepass.analysis.gemms import Scopes
from moepass.analysis.output_head import head_sign
from moepass.analysis.weight_parameter import weight_parameter
from moepass.analysis.scopes import Scope, dataflow
from moepass.analysis.sharded_gemm import sharded_gemm
from moepass.analysis.torchao_converted import left_to_torchao, skip_torchao_gemm_calls, taken_from_torchao
from moepass.analysis.graph import example_value, insert_call, is_gemm, op_short_name, reaches, tensor_meta
from moepass.analysis.node_module import module_path
from moepass.analysis.gemm_rules import module_filter_problem
from moepass.analysis.autocast import Bf16Gemm, gemm_precision
from moepass.analysis.bf16_operands import cast_to_bf16, erase_unused, without_bf16_copy
from moepass.recipes.plan import apply_plan, plan_gemm
from moepass.skips import Reason, SkipCode

NAME = "linear"
log = logging.getLogger(__name__)

# ops that pick experts: the router is the linear whose scores reach one of these before any GEMM
_ALWAYS_SELECTING = {"topk", "argsort", "argmax", "argmin", "nonzero", "argwhere", "multinomial"}
_SELECTING_WITH_INDICES = {"max", "min", "sort", "kthvalue", "mode"}  # when their indices output is used
_ADD = {operator.add, operator.iadd, torch.add}


@dataclasses.dataclass
class LinearMatch:
    node: fx.Node
    x: fx.Node | None
    weight: fx.Node | None  # as the graph holds it: [N, K], or [K, N] when layout is KN (read transposed)
    bias: fx.Node | None
    module: str
    role: str | None  # "router", "output_head" or None
    scope: Scope  # the graph holding the node: the top graph or a HOP body (activation checkpoint, ...)
    spelling: str = "linear"  # what the user wrote: "linear", "matmul", "mm", "addmm", "einsum", "bmm", ...
    layout: str = NK
    x_order: tuple[int, ...] | None = None  # einsum: x permuted so K comes last and its dims in output order
    n_dim: int | None = None  # einsum: where N sits in the output when not last
    problem: Reason | None = None  # a GEMM on a parameter that is no linear: why it stays BF16
    why: str = ""  # what shows its role (the output head's sign), or why the last GEMM of its graph is no head


def _selects_experts(n: fx.Node) -> bool:
    """top-k, arg-max, sort indices, threshold masks turned into indices (PhiMoE's sparsemixer uses max)."""
    name = op_short_name(n)
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


def _role(g, node: fx.Node, n, gm: fx.GraphModule, weight: fx.Node, scopes: Scopes,
          index: module_paths.ModuleIndex) -> tuple[str | None, str]:
    """("router" | "output_head" | None, what shows it) for a linear with N outputs."""
    downstream = reaches(g, node, stop_at=is_gemm)
    if any(_selects_experts(d) for d in downstream):
        return "router", "its output feeds expert selection (top-k, arg-max, sort)"
    out = example_value(node)
    numel = out.numel() if isinstance(out, torch.Tensor) else 0
    # a body output the data flow does not follow (an autograd.Function's) may reach anything
    leaves_unfollowed = any(d.op == "output" and d.graph is not gm.graph and not list(g.successors(d))
                            for d in downstream)
    if leaves_unfollowed or any(is_gemm(d) or _is_residual_add(d, numel) for d in downstream):
        return None, ""
    sign = head_sign(g, node, weight, downstream, n, weight_parameter(weight, scopes, index), gm, scopes, index)
    if sign is not None:
        return ("output_head" if sign.head else None), sign.why
    return None, "the last GEMM of its graph, with no sign of the output head (loss, vocabulary, tied weight, return)"


def find_linears(gm: fx.GraphModule, scopes: Scopes | None = None) -> list[LinearMatch]:
    """Every GEMM on a parameter (and every F.linear) in the graph and its HOP bodies, read as y = x @ W.T (+ b),
    with its role, or with the reason it is no linear. Pure: does not touch the graph."""
    scopes = scopes or Scopes(gm)
    g = dataflow(scopes.entered)
    index = module_paths.current()
    return [m for scope in scopes.entered for m in _scope_linears(scope, g, gm, scopes, index)]


def _scope_linears(scope: Scope, g, gm: fx.GraphModule, scopes: Scopes, index) -> list[LinearMatch]:
    matches = []
    for node in scope.graph.nodes:
        gemm = parameter_gemm(node, scopes)
        if gemm is None:
            continue
        module = module_path(node)
        w = tensor_meta(gemm.weight)
        role, why = None, ""
        if gemm.problem is None and w is not None and w.dim() == 2:
            role, why = _role(g, node, w.shape[0 if gemm.layout == NK else 1], gm, gemm.weight, scopes, index)
        matches.append(LinearMatch(node, gemm.x, gemm.weight, gemm.bias, module, role, scope, gemm.spelling,
                                   gemm.layout, gemm.x_order, gemm.n_dim, gemm.problem, why))
    return matches


def _problem(m: LinearMatch, config) -> Reason | Bf16Gemm:
    """Why the linear stays as it is, or its operands as the op takes them (BF16 as held, or by autocast)."""
    problem = left_to_torchao(m.node, config) or m.problem  # what the user converted with torchao stays theirs
    if problem:
        return problem
    lowp = config.section("lowp")
    if m.role == "router" and lowp.keep_router_bf16:
        return Reason(SkipCode.ROUTER_GATE, "router gate: its output feeds expert selection (top-k, arg-max, sort) "
                                            "(kept BF16; lowp.keep_router_bf16)")
    if m.role == "output_head" and lowp.keep_output_head_bf16:
        return Reason(SkipCode.OUTPUT_HEAD, f"output head (vocabulary projection) {m.module!r}: {m.why} (kept BF16 "
                                            "by lowp.keep_output_head_bf16)")
    problem = module_filter_problem(m.module, config)
    if problem:
        return problem
    bias = m.bias if isinstance(m.bias, fx.Node) else None
    precision = gemm_precision(m.node, m.scope, "the linear", {"activation": m.x, "weight": m.weight, "bias": bias})
    if isinstance(precision, Reason):
        return precision
    x, w = tensor_meta(m.x), tensor_meta(m.weight)
    if w.dim() != 2 or x.dim() < 2:
        return Reason(SkipCode.NOT_2D_WEIGHT, f"weight is {w.dim()}-D and activation {x.dim()}-D; expected a 2-D "
                                              "weight and >= 2-D activation")
    return precision


def run(gm: fx.GraphModule, config, record) -> None:
    scopes = Scopes(gm)
    for m in find_linears(gm, scopes):
        with record.in_scope(m.scope):
            _rewrite(m, config, record, scopes)
    skip_torchao_gemm_calls(gm, "linear", config, record)  # torchao's opaque linear calls: no node to match
    log.debug("linear: %d rewritten, %d skipped", len(record.rewrites), len(record.skipped))


def _normalised_operands(m: LinearMatch, precision: Bf16Gemm) -> tuple[fx.Node, fx.Node, fx.Node | None,
                                                                          list[fx.Node]]:
    """(x, W as [N, K], bias, the nodes inserted for them): the casts autocast makes at dispatch (activation, bias),
    the float32 weight where the graph reads a BF16 copy of it, and the permute and transpose views the rewrite
    reads."""
    graph, added = m.scope.graph, []
    x, w, bias = m.x, without_bf16_copy(graph, m.weight, m.node), m.bias
    if w is not m.weight:
        added.append(w)
    if "activation" in precision.cast:
        x = cast_to_bf16(graph, x, m.node)
        added.append(x)
    if "bias" in precision.cast:
        bias = cast_to_bf16(graph, bias, m.node)
        added.append(bias)
    with graph.inserting_before(m.node):
        if m.x_order is not None:
            x = insert_call(graph, torch.permute, (x, m.x_order), tensor_meta(x).permute(m.x_order), m.node)
            added.append(x)
        if m.layout == KN:
            w = insert_call(graph, torch.t, (w,), tensor_meta(w).t(), m.node)
            added.append(w)
    return x, w, bias, added


def _rewrite(m: LinearMatch, config, record, scopes: Scopes) -> None:
    # the operands as the node holds them now: an earlier rewrite may have replaced one (a linear fed straight
    # from another, `b(a(x))`), and the match recorded the node it replaced
    now = parameter_gemm(m.node, scopes)
    m = dataclasses.replace(m, x=now.x, bias=now.bias) if now is not None else m
    precision = _problem(m, config)
    if isinstance(precision, Reason):
        record.skip(m.node, m.module, precision)
        return
    x_node, w_node, bias, added = _normalised_operands(m, precision)
    sharded = sharded_gemm("linear", [x_node, w_node, bias])
    if isinstance(sharded, Reason):
        _erase(m.scope.graph, added)
        record.skip(m.node, m.module, sharded.plus(" (the weight read transposed, as [N, K])")
                    if m.layout == KN else sharded)
        return
    x = tensor_meta(x_node)
    # under tensor parallelism each rank runs the GEMM on its shards: plan (alignment, speed) on their sizes
    x_shape, (n, k) = (x.shape, tensor_meta(w_node).shape) if sharded is None else sharded.local_shapes[:2]
    plan = plan_gemm(config, "linear", x.device, math.prod(x_shape[:-1]), k, n)
    shards = "" if sharded is None else f" per shard ({sharded.layout})"
    if isinstance(plan, Reason):
        _erase(m.scope.graph, added)
        record.skip(m.node, m.module, plan.plus(f" [K and N{shards}]") if shards else plan)
        return
    spelled = "" if m.spelling == "linear" else f" (from {m.spelling}{', W read [K, N]' if m.layout == KN else ''})"
    note = f"; {m.why}, so eligible" if m.why and m.role is None else ""
    moved = _output_in_order(m)
    apply_plan(record, m.scope.graph, m.node, m.module, plan, (x_node, w_node, bias),
               f"K={k} N={n}{shards}{spelled}{note}{precision}{_weight_note(w_node)}"
               f"{taken_from_torchao(m.node)}")
    erase_unused(m.scope.graph, m.weight)  # the BF16 copy of a float32 weight, where the op reads the weight itself
    if moved is not None:  # the op's output holds N last; the einsum's user reads it where the einsum put it
        op = moved.args[0]
        op.meta["example_value"] = tensor_meta(moved).movedim(m.n_dim, -1)
        op.meta.pop("val", None)


def _weight_note(w_node: fx.Node) -> str:
    w = tensor_meta(w_node)
    return f"; W read in {w.dtype} (quantized from it, no BF16 copy)" if w.dtype != torch.bfloat16 else ""


def _erase(graph: fx.Graph, added: list[fx.Node]) -> None:
    for node in reversed(added):  # the casts and views inserted for a rewrite that is not made
        if not node._erased:  # erase_unused may have taken it with a view inserted after it
            erase_unused(graph, node)


def _output_in_order(m: LinearMatch) -> fx.Node | None:
    """For an einsum with N not last: a movedim after the node, taking over its users (the node then feeds it)."""
    if m.n_dim is None:
        return None
    with m.scope.graph.inserting_after(m.node):
        moved = insert_call(m.scope.graph, torch.movedim, (m.node, -1, m.n_dim), tensor_meta(m.node), m.node)
    m.node.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
    return moved
