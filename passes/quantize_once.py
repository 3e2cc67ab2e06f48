"""quantize_once: expert GEMMs read their rows quantized once, before the gather that routes them.

An expert's input rows are a gather of token rows (`x[token_of_slot]`, `x.index_select(0, idx)`; under EP, of the
rows a dispatch received), and the recipe's quantization of x (per row along K: fp8_rowwise's one scale per row,
blockwise's 1x128 tiles) commutes with a gather of rows. So this pass quantizes the gather's source once
(moepass::<recipe>_quantize_rows, which Inductor fuses into the source's producer), gathers the FP8 rows and their
scales along the same chain of gathers, and runs the expert GEMM as moepass::<recipe>_grouped_mm_rows on them: T rows
quantized instead of T * top_k, once for w1 and w3 alike, half the bytes gathered, and FP8 rows saved for the
backward instead of BF16 ones (ops/lowp/grouped_mm_rows.py says what that means for the wgrad). The forward and the
dgrad are bit-equal to the grouped_mm pass's ops. GEMMs whose input is no gather get the rows form too (x quantized
where it is, saved in FP8 once for w1 and w3).

Runs after grouped_mm, on its ops; a GEMM it cannot serve stays as grouped_mm left it, with the reason.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from moepass.analysis.dtensors import is_dtensor
from moepass.analysis.scopes import graph_scopes
from moepass.emit import Emitter
from moepass.graph import example_value, module_path, replace_node, tensor_meta
from moepass.op_registry import GemmRole, gemm_role, is_rows_form, rows_form
from moepass.skips import Reason, SkipCode

NAME = "quantize_once"
SUMMARY = ("moepass::<recipe>_grouped_mm(x[idx], ...) -> <recipe>_grouped_mm_rows(x[idx], q[idx], scale[idx], ...) "
           "with q, scale = <recipe>_quantize_rows(x): expert rows quantized once, before their gather")

log = logging.getLogger(__name__)

_GROUPED_FORWARD = GemmRole("grouped", "forward")
_INDEX_SELECT = {torch.index_select, torch.ops.aten.index_select.default, "index_select"}


def gathered_from(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(source, index) when `node` is a gather of whole rows of a 2-D source by a 1-D integer index: x[idx],
    x[idx, :], x.index_select(0, idx), aten.index(x, [idx]); else None."""
    if node.op not in ("call_function", "call_method"):
        return None
    args = node.args
    if node.target is operator.getitem and len(args) == 2:
        source, index = args
        if isinstance(index, tuple) and len(index) == 2 and index[1] == slice(None):
            index = index[0]
        elif isinstance(index, tuple) and len(index) == 1:
            index = index[0]
    elif node.target is torch.ops.aten.index.Tensor and len(args) == 2 and len(args[1]) == 1:
        source, index = args[0], args[1][0]
    elif node.target in _INDEX_SELECT and len(args) == 3 and args[1] == 0 and not node.kwargs:
        source, index = args[0], args[2]
    else:
        return None
    src, idx = tensor_meta(source), tensor_meta(index)
    if src is None or idx is None or src.dim() != 2 or idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
        return None
    return source, index


def run(gm: fx.GraphModule, example_inputs, config, record) -> None:
    for scope in graph_scopes(gm):
        quantized = {}  # (gathered node, settings, kernel) -> its (q, scale) nodes: w1 and w3 share them
        with record.in_scope(scope):
            for node in list(scope.graph.nodes):
                if node.op != "call_function" or gemm_role(node.target) != _GROUPED_FORWARD \
                        or is_rows_form(node.target):
                    continue
                form = rows_form(node.target)
                if form is None:
                    record.skip(node, module_path(node), Reason(
                        SkipCode.NO_ROWS_FORM, f"{node.target.name()} has no rows form: its kernels quantize x "
                                               "themselves"))
                else:
                    _rewrite_or_leave(scope.graph, node, form, config, record, quantized)


def _rewrite_or_leave(graph: fx.Graph, node: fx.Node, form, config, record, quantized: dict) -> None:
    """_rewrite, or on an unexpected error the graph as it was (nodes it added removed) and the error reported."""
    before = set(graph.nodes)
    try:
        _rewrite(graph, node, form, config, record, quantized)
    except Exception as error:  # a moepass problem never fails the user's compile
        log.warning("quantize_once: left %s alone: %r", node.name, error, exc_info=True)
        for added in reversed([n for n in graph.nodes if n not in before]):
            if not added.users:
                graph.erase_node(added)
        alive = set(graph.nodes)
        for key in [k for k, (q, scale, _) in quantized.items() if q not in alive or scale not in alive]:
            del quantized[key]
        record.skip(node, module_path(node), Reason(SkipCode.REWRITE_ERROR, f"could not rewrite: {error!r}"))


def _rewrite(graph: fx.Graph, node: fx.Node, form, config, record, quantized: dict) -> None:
    module = module_path(node)
    x, w_t, offs, *rest = node.args
    *settings, wgrad_bf16, kernel = rest
    if kernel not in form.kernels:
        record.skip(node, module, Reason(SkipCode.NO_ROWS_FORM, f"kernel {kernel!r} has no rows form "
                                                                 f"(those with one: {list(form.kernels)})"))
        return
    value = example_value(x)
    if not isinstance(value, torch.Tensor):
        record.skip(node, module, Reason(SkipCode.NO_METADATA, "the rows have no recorded tensor metadata"))
        return
    if is_dtensor(value):
        record.skip(node, module, Reason(SkipCode.ROWS_ARE_DTENSORS, "the rows are DTensors (expert tensor "
                                                                      "parallelism); quantized where they are read"))
        return
    with graph.inserting_before(node):
        q, scale, gathers = _quantized_rows(Emitter(graph, value.fake_mode), x, form, tuple(settings), kernel,
                                            quantized)
    saved_fp8 = config["quantize_once.saved_rows"] == "fp8"
    new = replace_node(graph, node, form.grouped_mm.default, (x, q, scale, w_t, offs, saved_fp8, *rest))
    where = f"quantized before {gathers} gather(s) of rows" if gathers else "quantized where they are"
    saved = "FP8 rows saved for the wgrad" if saved_fp8 else "BF16 rows saved for the wgrad"
    record.replace(node, module, f"moepass.{new.target.name().split('::')[-1]}", f"rows {where}; {saved}")


def _quantized_rows(emit: Emitter, x: fx.Node, form, settings: tuple, kernel: str, quantized: dict):
    """(q, scale) nodes of x's rows, and how many gathers they were moved before: quantize the source of x's chain of
    row gathers, then replay each gather on q and scale (nodes shared with every GEMM reading the same rows)."""
    key = (x, settings, kernel)
    if key in quantized:
        return quantized[key]
    found = gathered_from(x)
    if found is None:
        source = emit("detach", x, method=True)  # a quantization has no gradient: the GEMM's x carries it
        quant = emit(form.quantize.default, source, *settings, kernel)
        result = (emit(operator.getitem, quant, 0), emit(operator.getitem, quant, 1), 0)
    else:
        source, index = found
        q, scale, gathers = _quantized_rows(emit, source, form, settings, kernel, quantized)
        result = (emit(operator.getitem, q, index), emit(operator.getitem, scale, index), gathers + 1)
    quantized[key] = result
    return result
