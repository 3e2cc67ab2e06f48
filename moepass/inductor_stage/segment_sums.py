"""Scatter-adds of rows into zeros become moepass::segment_sum_rows (sorted segment sums, no atomics).

An MoE adds its experts' output rows into their tokens (`zeros.index_add(0, token_of_slot, y)`, or scatter_add with
the index expanded over the columns), and the backward of each gather of token rows (`x[token_of_slot]`) is the same
sum: `index_put(zeros, [idx], grad, accumulate=True)`. Inductor lowers them to an atomic add per element into a
zeroed buffer: at DeepSeek-V3 dims (7168 columns, 8 rows a token) the two took 6.2 ms of a 121 ms MoE layer on an
H100 (examples/results/prof_671B_h100_5a98df7/). moepass::segment_sum_rows reads each row once and writes each
output row once, in a fixed order (ops/rows/segment_sum.py).

This pass runs on each graph Inductor compiles (forward and backward), after AOTAutograd: there every spelling of the
sum (index_add, index_put with accumulate, scatter_add, and the backward of x[idx], index_select and gather) is one of
three aten ops; torchtitan's combine calls its own `torchtitan::deterministic_scatter_add` (a scatter_add made
deterministic: so is this sum). It rewrites one when:
- it adds into a zero tensor [n, D] (a fresh one: these ops are functional), along dim 0, with one 1-D integer index;
- its rows are float [M, D] and n is known at compile time;
- the graph runs on a device `segment_sums.devices` allows ("cuda": where the Triton kernel runs).
What it reads is the rows' producers where they are written anyway: a widening cast (bf16 -> fp32, exact) is read
through, and a sum of GEMM outputs (the dgrads of w1 and w3) is added inside the kernel instead of written first.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from ..analysis.graph import tensor_meta
from ..ops.rows.segment_sum import MAX_SRCS  # importing it registers moepass::segment_sum_rows

log = logging.getLogger(__name__)
aten, prims = torch.ops.aten, torch.ops.prims

# ops Inductor runs as kernels of their own (their outputs are in memory anyway): read directly, nothing is lost
EXTERN = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten._grouped_mm.default, aten._scaled_mm.default,
          aten._scaled_grouped_mm.default}


def rewrite(graph: fx.Graph, devices: tuple[str, ...] | None) -> list[str]:
    """Rewrite every scatter-add of rows into zeros on `devices` (device types; None: any); the names of those
    rewritten."""
    done = []
    for node in list(graph.nodes):
        found = scatter_add(node, devices)
        if found is None:
            continue
        zeros, index, values = found
        val = node.meta["val"]
        with graph.inserting_before(node):
            if index.meta["val"].dim() != 1:  # scatter_add's index [M, 1] expanded over the columns
                index = graph.call_function(aten.squeeze.dim, (index, 1))
                index.meta["val"] = index.args[0].meta["val"].squeeze(1)
            summed = graph.call_function(torch.ops.moepass.segment_sum_rows.default,
                                         (_terms(values, MAX_SRCS), index, int(val.shape[0]), val.dtype))
        summed.meta["val"] = val
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        if not zeros.users:  # the ops are functional: one zero tensor may be the start of several sums
            graph.erase_node(zeros)
        _erase_unread(values)
        done.append(node.name)
    return done


def scatter_add(node: fx.Node, devices: tuple[str, ...] | None) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(zeros, index, values) when `node` is a scatter-add of rows into zeros this pass rewrites on `devices` (device
    types; None: any)."""
    if node.op != "call_function":
        return None
    if node.target is aten.index_put.default:
        zeros, indices, values, *rest = node.args
        if not (rest and rest[0]) or len(indices) != 1 or not isinstance(indices[0], fx.Node):
            return None
        index = indices[0]
    elif node.target is aten.index_add.default:
        zeros, dim, index, values = node.args
        if dim != 0 or node.kwargs.get("alpha", 1) != 1:
            return None
    elif node.target is aten.scatter_add.default:
        zeros, dim, expanded, values = node.args
        index = _column(expanded)
        if dim != 0 or index is None:
            return None
    elif _is_op(node.target, "torchtitan", "deterministic_scatter_add"):  # scatter_add along dim 0, made deterministic
        zeros, expanded, values = node.args
        index = _column(expanded)
        if index is None:
            return None
    else:
        return None
    out, rows, idx = (tensor_meta(n) for n in (node, values, index))
    if out is None or rows is None or idx is None or (devices is not None and out.device.type not in devices):
        return None
    if out.dim() != 2 or rows.dim() != 2 or not out.dtype.is_floating_point or rows.dtype != out.dtype:
        return None
    if idx.dtype not in (torch.int32, torch.int64) or idx.shape[0] != rows.shape[0] or idx.dim() not in (1, 2):
        return None
    if not isinstance(out.shape[0], int) or not all(isinstance(s, int) for s in rows.shape):
        return None  # dynamic shapes: n must be a compile-time int
    if rows.shape[1] != out.shape[1] or not _zeros(zeros):
        return None
    return zeros, index, values


def _is_op(target, namespace: str, name: str) -> bool:
    """An op found by its name, from a library moepass does not import."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace == namespace and target._opname == name


def _column(expanded) -> fx.Node | None:
    """scatter_add's index [M, D] when it is one column [M, 1] expanded: that column."""
    if not (isinstance(expanded, fx.Node) and expanded.target is aten.expand.default):
        return None
    column = expanded.args[0]
    meta = tensor_meta(column)
    return column if meta is not None and meta.dim() == 2 and meta.shape[1] == 1 else None


def _zeros(node) -> bool:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if node.target is aten.full.default:
        return node.args[1] == 0
    return node.target in (aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default)


def _widened(node: fx.Node) -> fx.Node:
    """A bf16 / fp16 -> fp32 cast's input (the kernel sums in fp32: the same values); else the node."""
    if node.target is prims.convert_element_type.default and node.args[1] == torch.float32:
        meta = tensor_meta(node.args[0])
        if meta is not None and meta.dtype in (torch.bfloat16, torch.float16):
            return node.args[0]
    return node


def _in_memory(node: fx.Node) -> bool:
    """Written to memory whatever reads it: a graph input, a GEMM, a custom op's output."""
    if node.op == "placeholder" or node.target is operator.getitem or node.target in EXTERN:
        return True
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
        target.namespace not in ("aten", "prims")


def _terms(values: fx.Node, most: int) -> list[fx.Node]:
    """What the kernel reads for `values`: the terms of a sum of rows already in memory (at most `most`), else the
    values themselves (a widening cast read through)."""
    terms, pending = [], [values]
    while pending and len(terms) + len(pending) <= most:
        node = _widened(pending.pop(0))
        if node.target is aten.add.Tensor and len(node.args) == 2 and not node.kwargs and \
                all(isinstance(a, fx.Node) and tensor_meta(a) is not None and
                    tensor_meta(a).shape == tensor_meta(node).shape for a in node.args):
            pending.extend(node.args)
        else:
            terms.append(node)
    if pending or not all(_in_memory(t) for t in terms):
        return [_widened(values)]
    return terms


def _erase_unread(node: fx.Node) -> None:
    """Erase `node` and the pointwise nodes feeding only it, once nothing reads them (the casts and sums read
    through)."""
    pending = [node]
    while pending:
        n = pending.pop()
        if n.users or n.op != "call_function" or n.target not in (aten.add.Tensor, prims.convert_element_type.default):
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        pending.extend(inputs)
