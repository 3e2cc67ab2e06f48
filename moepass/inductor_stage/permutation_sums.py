"""Scatter-adds along a routing permutation as gather-sums Inductor fuses (`segment_sums.permutations: "gather"`).

An MoE's combine adds each token's top_k expert rows: `zeros.index_add(0, slot_order // top_k, y)`, where slot_order
sorts the token's slots by expert (a permutation of range(T * top_k)). The backward of the gather x[slot_order // top_k]
is the same sum. With that index every token has exactly top_k rows, at the positions inv[t * top_k + k] (inv the
inverse permutation), so the sum is `y[inv.view(T, top_k)].sum(1)`: a gather and a reduction of top_k rows, which
Inductor compiles into one kernel together with what makes y (a GEMM's epilogue, the sum of the dgrads of w1 and w3)
and the cast. moepass::segment_sum_rows needs y written out first (examples/results/segment_sums_h100_ced78e1/: 6.1 ms
a step of the 9.3 its path took).

This runs on the joint graph, where the forward's sort is visible from the backward's sum too. It rewrites a sum that
segment_sums.py would take (into zeros, dim 0, float rows [M, D]) whose index is `getitem(sort(t), 1) // K` (or a
floor division by K) with M == n * K; the sums in FP32, rounded once to the output's dtype.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

from . import segment_sums

aten, prims = torch.ops.aten, torch.ops.prims
TAG = "moepass_rewrite"  # node meta key of what a moepass rewrite inside Inductor left behind (cache_key's audit)


def rewrite(graph: fx.Graph) -> list[str]:
    """Rewrite each sum along a routing permutation (any device); the names of those rewritten."""
    done = []
    fake_mode = detect_fake_mode([n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)])
    for node in list(graph.nodes):
        found = segment_sums.scatter_add(node, devices=None)
        if found is None:
            continue
        zeros, index, values = found
        out = node.meta["val"]
        groups = _permutation_groups(index, int(out.shape[0]), int(values.meta["val"].shape[0]))
        if groups is None:
            continue
        perm, k = groups
        add = _adder(graph, node, fake_mode)
        m = perm.meta["val"].shape[0]
        steps = add(aten.arange.start_step, (0, m, 1), {"dtype": perm.meta["val"].dtype,
                                                       "device": perm.meta["val"].device})
        inverse = add(aten.scatter.src, (add(aten.empty_like.default, (perm,)), 0, perm, steps))
        rows = add(aten.index.Tensor, (values, [add(aten.view.default, (inverse, [out.shape[0], k]))]))
        if rows.meta["val"].dtype != torch.float32:
            rows = add(prims.convert_element_type.default, (rows, torch.float32))
        summed = add(aten.sum.dim_IntList, (rows, [1]))
        if out.dtype != torch.float32:
            summed = add(prims.convert_element_type.default, (summed, out.dtype))
        summed.meta[TAG] = "permutation_gather_sum"  # the partitioner keeps node meta: the audit counts it
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        if not zeros.users:
            graph.erase_node(zeros)
        done.append(node.name)
    return done


def _permutation_groups(index: fx.Node, n: int, m: int) -> tuple[fx.Node, int] | None:
    """(perm, K) when `index` is perm // K, perm the indices of a sort of m values and m == n * K."""
    if index.op != "call_function":
        return None
    if index.target is aten.div.Tensor_mode and index.kwargs.get("rounding_mode") == "floor":
        perm, k = index.args
    elif index.target is aten.floor_divide.default:
        perm, k = index.args
    else:
        return None
    if not isinstance(k, int) or k < 1 or m != n * k or not _sort_indices(perm):
        return None
    return perm, k


def _sort_indices(node) -> bool:
    """The indices a 1-D sort returns: a permutation of range(its length)."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 1):
        return False
    sort = node.args[0]
    if not (isinstance(sort, fx.Node) and sort.target in (aten.sort.default, aten.sort.stable)):
        return False
    source = sort.args[0].meta.get("val") if isinstance(sort.args[0], fx.Node) else None
    return isinstance(source, torch.Tensor) and source.dim() == 1


def _adder(graph: fx.Graph, before: fx.Node, fake_mode):
    """A function inserting `target(*args, **kwargs)` before `before`, its meta value computed on fake tensors."""
    def add(target, args, kwargs=None) -> fx.Node:
        kwargs = kwargs or {}
        with graph.inserting_before(before):
            node = graph.call_function(target, args, kwargs)
        fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
        return node
    return add
