"""Gathers of whole rows, in Dynamo graphs (`x[idx]`, `x[idx, :]`, `x.index_select(0, idx)`) and aten graphs
(`aten.index(x, [idx])`, `aten.index_select(x, 0, idx)`): quantize_once moves quantization before them, and
regather_rows has the backward gather FP8 rows again."""

from __future__ import annotations

import operator

import torch
from torch import fx

from moepass.analysis.graph import tensor_meta

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
