"""Which nn.Module issued a graph node: its state_dict path, for the passes' filters and the report."""

from __future__ import annotations

from torch import fx

from .graph import is_gemm
from .module_paths import normalize_module_path, resolve
from .weight_parameter import module_by_weight


def module_path(node: fx.Node) -> str:
    """Module path of the innermost nn.Module that issued the node ('' at top level): its full state_dict
    path when the live module is found (inside a backend call; see moepass.analysis.module_paths), else the path
    Dynamo recorded, relative to the compiled frame. A GEMM issued at top level is named by its weight."""
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        key, (raw, _) = list(stack.items())[-1]
        full = resolve(key)
        path = full if full is not None else normalize_module_path(raw)
    if not path and is_gemm(node):
        path = module_by_weight(node)
    return path
