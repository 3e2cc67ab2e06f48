"""grouped_mm (old name: mxfp8_grouped_mm): `torch._grouped_mm(x, w_t, offs=...)` expert GEMMs ->
moepass::<recipe>_grouped_mm (mxfp8, fp8_rowwise or blockwise), per the `recipe` option (moepass.recipes).

The 2-D x 3-D form with int32 group-end offsets is the routed-experts GEMM of MoE layers
(torchtitan, HF transformers' grouped_mm experts, our models/). Its forward, dgrad and wgrad run
in FP8 (MXFP8, rowwise e4m3 on Hopper, or DeepSeek-V3's blockwise e4m3 on request; the wgrad in BF16 under the
recipe's wgrad_bf16 option); token group alignment is handled inside the ops, never visibly.
Autocast does not cast torch._grouped_mm: models running under it cast the operands themselves (torchtitan:
`w.bfloat16().transpose(-2, -1)`), and the op reads the FP32 weight through that cast (no BF16 copy is made).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
from torch import fx

from moepass.analysis.routed_rows import RoutedRows
from moepass.analysis.scopes import Scope, graph_scopes
from moepass.analysis.sharded_gemm import sharded_gemm
from moepass.analysis.torchao_converted import left_to_torchao, skip_torchao_gemm_calls, taken_from_torchao
from moepass.analysis.graph import is_grouped_mm, node_arg, tensor_meta
from moepass.analysis.node_module import module_path
from moepass.analysis.opaque_grouped_mm import read_as_grouped_mm
from moepass.analysis.gemm_rules import module_filter_problem
from moepass.analysis.autocast import Bf16Gemm, gemm_precision
from moepass.analysis.bf16_operands import cast_to_bf16, erase_unused, without_bf16_copy
from moepass.recipes.plan import apply_plan, plan_gemm
from moepass.skips import Reason, SkipCode

NAME = "grouped_mm"
log = logging.getLogger(__name__)


@dataclasses.dataclass
class GroupedMMMatch:
    node: fx.Node
    x: fx.Node
    w_t: fx.Node
    offs: fx.Node | None
    bias: object
    out_dtype: object
    module: str
    scope: Scope  # the graph holding the node: the top graph or a HOP body (activation checkpoint, ...)


def find_grouped_mms(gm: fx.GraphModule) -> list[GroupedMMMatch]:
    """Every grouped GEMM node in the graph and its HOP bodies, with its operands read from positional or
    keyword form. Pure."""
    return [
        GroupedMMMatch(n, n.args[0], node_arg(n, 1, "mat2", node_arg(n, 1, "mat_b")), node_arg(n, 2, "offs"),
                       node_arg(n, 3, "bias"), node_arg(n, 4, "out_dtype"), module_path(n), scope)
        for scope in graph_scopes(gm) for n in scope.graph.nodes if is_grouped_mm(n)
    ]


def _problem(m: GroupedMMMatch, config) -> Reason | Bf16Gemm:
    """Why the grouped GEMM stays as it is, or its operands as the op takes them (BF16 as held, or by autocast)."""
    problem = left_to_torchao(m.node, config) or module_filter_problem(m.module, config)
    if problem:
        return problem
    x, w = tensor_meta(m.x), tensor_meta(m.w_t)
    if x is None or w is None:
        return Reason(SkipCode.NO_METADATA, "operands have no recorded tensor metadata")
    if x.dim() != 2 or w.dim() != 3 or m.offs is None:
        return Reason(SkipCode.NOT_MOE_FORM, f"{x.dim()}-D x {w.dim()}-D grouped GEMM"
                                             f"{' without offs' if m.offs is None else ''}; only the MoE form "
                                             "x[M,K] @ w_t[E,K,N] with offs is rewritten")
    if m.bias is not None:
        return Reason(SkipCode.GROUPED_BIAS, "grouped GEMM with bias is not rewritten")
    if m.out_dtype not in (None, torch.bfloat16):
        return Reason(SkipCode.OUT_DTYPE, f"out_dtype={m.out_dtype} requested; the low-precision ops return bfloat16")
    offs = tensor_meta(m.offs)
    if offs is None or offs.dtype != torch.int32:
        return Reason(SkipCode.OFFS_NOT_INT32,
                      f"offs is {getattr(offs, 'dtype', 'not a tensor')}, expected int32 group end offsets")
    return gemm_precision(m.node, m.scope, "torch._grouped_mm", {"activation": m.x, "weight": m.w_t})


def run(gm: fx.GraphModule, config, record) -> None:
    routed_rows = functools.cache(lambda: RoutedRows(gm))  # built only if a row count is data dependent
    read_as = read_as_grouped_mm(gm)  # custom ops that compute torch._grouped_mm (transformers' FP32 experts) become it
    for m in find_grouped_mms(gm):
        with record.in_scope(m.scope):
            _rewrite(m, config, record, routed_rows)
    skip_torchao_gemm_calls(gm, "grouped", config, record)  # torchao's opaque grouped GEMM calls: no node to match
    read_as.restore_left_alone(record)  # those left alone call their own op again; their reasons name it
    log.debug("grouped_mm: %d rewritten, %d skipped", len(record.rewrites), len(record.skipped))


def _rewrite(m: GroupedMMMatch, config, record, routed_rows) -> None:
    # the tokens as the node holds them now: an earlier rewrite may have replaced the node the match recorded
    m = dataclasses.replace(m, x=m.node.args[0])
    precision = _problem(m, config)
    if isinstance(precision, Reason):
        record.skip(m.node, m.module, precision)
        return
    graph = m.scope.graph
    # the float32 weight where the model reads a BF16 copy of it (torchtitan's `w.bfloat16().transpose(-2, -1)`)
    w_t = without_bf16_copy(graph, m.w_t, m.node)
    x = cast_to_bf16(graph, m.x, m.node) if "activation" in precision.cast else m.x
    sharded = sharded_gemm("grouped_mm", [x, w_t, m.offs])
    if isinstance(sharded, Reason):
        for added in (x, w_t):
            if added not in (m.x, m.w_t):
                erase_unused(graph, added)
        record.skip(m.node, m.module, sharded)
        return
    # expert tensor parallelism on DTensors: plan (alignment, speed) on each rank's shards
    x_shape, (e, k, n) = (tensor_meta(x).shape, tensor_meta(w_t).shape) if sharded is None \
        else sharded.local_shapes[:2]
    # rows received by expert parallelism are known at run time only: recipe=auto decides on the rows to expect
    plan = plan_gemm(config, "grouped", tensor_meta(x).device, x_shape[0], k, n, experts=e,
                     expected=lambda: routed_rows().expected(m.x))
    shards = "" if sharded is None else f" per shard ({sharded.layout})"
    if isinstance(plan, Reason) and shards:
        plan = plan.plus(f" [K and N{shards}]")
    weight = "" if tensor_meta(w_t).dtype == torch.bfloat16 else \
        f"; w_t read in {tensor_meta(w_t).dtype} (quantized from it, no BF16 copy)"
    apply_plan(record, graph, m.node, m.module, plan, (x, w_t, m.offs),
               f"E={e} K={k} N={n}{shards}{precision}{weight}{taken_from_torchao(m.node)}")
    for operand in (x, w_t, m.w_t):  # a plan's Reason leaves them unread; a rewrite leaves the BF16 copy unread
        erase_unused(graph, operand)
