"""A selective activation-checkpoint policy written for BF16 sees moepass's GEMMs as the aten ops they replaced.

SAC policies (torchtitan's op list, a user's `create_selective_checkpoint_contexts(policy)`) choose per op, by op
identity, whether an output is saved or recomputed: `aten.mm`, `aten.addmm`, `aten._grouped_mm`. After the passes
a checkpoint body holds moepass's forward GEMM ops instead (moepass.op_registry), which no policy lists, so every
rewritten GEMM would be recomputed in the backward as under full AC. The body's context_fn is wrapped so that the
policy is asked about the op the BF16 graph held: a linear as the `aten.mm(x as 2-D, W.T)` (`addmm` with a bias)
it decomposes to, a grouped GEMM as `aten._grouped_mm`. Expert-parallel dispatch/combine are saved whatever the
policy says (ep_recompute.mark_exchanges_saved).
"""

from __future__ import annotations

import torch
from torch import fx

from ..analysis.scopes import graph_scopes
from .cache_key import source_hash
from ..op_registry import gemm_role

CONTEXT_FN = "_checkpoint_context_fn"  # where Dynamo keeps a checkpoint's context_fn: the body's meta


def _replaced(func, args):
    """(aten op, args) a policy written for BF16 expects in place of a moepass GEMM op, else None."""
    role = gemm_role(func) if isinstance(func, torch._ops.OpOverload) else None
    if role is None or role.gemm != "forward":
        return None
    if role.kind == "linear":  # F.linear reaches aten as addmm (with a bias) or mm of the 2-D view
        x, weight, bias = args[0], args[1], args[2]
        x2, w_t = x.reshape(-1, x.shape[-1]), weight.t()
        return (torch.ops.aten.mm.default, (x2, w_t)) if bias is None else (torch.ops.aten.addmm.default,
                                                                            (bias, x2, w_t))
    if role.kind == "grouped":
        return torch.ops.aten._grouped_mm.default, tuple(args[:3])  # (x, w_t, offs): _grouped_mm's own order
    return None


def _asking_about_replaced(policy):
    def policy_fn(ctx, func, *args, **kwargs):
        replaced = _replaced(func, args)
        return policy(ctx, func, *args, **kwargs) if replaced is None else policy(ctx, replaced[0], *replaced[1])
    return policy_fn


def _translating(context_fn):
    def context():
        contexts = context_fn()
        for mode in contexts:  # the forward's caching mode (and the recompute's, where a torch version asks it)
            if callable(getattr(mode, "policy_fn", None)):
                mode.policy_fn = _asking_about_replaced(mode.policy_fn)
        return contexts

    context.moepass_translated = True
    if getattr(context_fn, "cache_hash", None) is not None:  # without one AOTAutograd bypasses its cache, as before
        context.cache_hash = f"{context_fn.cache_hash}-moepass-{source_hash()}"
    return context


def show_policies_replaced_gemms(gm: fx.GraphModule) -> int:
    """Wrap the context_fn of every selectively checkpointed body in `gm`; return how many were wrapped."""
    wrapped = 0
    for scope in graph_scopes(gm)[1:]:
        context_fn = scope.gm.meta.get(CONTEXT_FN)
        if context_fn is not None and not getattr(context_fn, "moepass_translated", False):
            scope.gm.meta[CONTEXT_FN] = _translating(context_fn)
            wrapped += 1
    return wrapped
