"""GEMMs on a parameter, however spelled, read as one form: y = x @ W.T (+ b) with W an [N, K] weight.

As Inductor's split_cat normalises every spelling of a split before matching one, this reads each spelling of a
linear-shaped GEMM into one record, and the linear pass rewrites that record alone:

    spelling                                          weight as the graph holds it     layout
    F.linear(x, W, b)                                 W [N, K]                         nk
    x @ W.t(), matmul(x, W.transpose(0, 1)), mm, .T   W [N, K] (the transpose read)    nk
    x @ W, matmul(x, W), mm(x, W)                     W [K, N]                         kn
    x_e @ W[e], x_e @ W[e].t() (W an expert stack)    W[e]                             kn / nk
    addmm(b, x, W) with b of shape [N]                W                                kn / nk
    einsum("bsd,nd->bsn", x, W), einsum("bsd,dn->bsn", x, W)  (x's letters in any order, N anywhere)

"kn" means the rewrite reads the weight transposed (a view, as `F.linear(x, W.t())` would). A GEMM on a parameter in
any other form is a record with the reason it is no linear: per-head or per-expert batches (an einsum letter shared
by x, the weight and the output; bmm / baddbmm / matmul of 3-D stacks), the parameter on the left, a vector weight,
two contracted letters. A product of two activations (attention's `q @ k.T`) gives no record.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from moepass.analysis.graph import is_addmm, is_batched_mm, is_einsum, is_linear, is_matmul, node_arg, tensor_meta
from moepass.skips import Reason, SkipCode

from .gemms import Scopes, weight_source

NK, KN = "nk", "kn"  # the weight as held: [N, K] (y = x @ W.T) or [K, N] (y = x @ W)
_DOTS = "0123456789"  # stand-ins for the dims an einsum's `...` spans
_TRANSPOSES = {"t", "transpose", "permute", "T", "mT", "swapaxes", "swapdims"}


@dataclasses.dataclass(frozen=True)
class ParameterGemm:
    """One GEMM read as y = x @ W.T (+ b), or the reason it is not one."""

    spelling: str  # "linear", "matmul", "mm", "addmm", "einsum", "bmm", ...
    x: fx.Node | None
    weight: fx.Node | None  # as the graph holds it: [N, K] when layout is NK, [K, N] when KN
    layout: str = NK
    bias: fx.Node | None = None
    x_order: tuple[int, ...] | None = None  # einsum: x permuted so its free dims come in output order and K last
    n_dim: int | None = None  # einsum: where N sits in the output when not last
    problem: Reason | None = None  # set when the GEMM reads a parameter but is no linear


def _spelling(node: fx.Node) -> str:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))
    return {"__matmul__": "matmul", "__rmatmul__": "matmul"}.get(name, name)


def transposed_2d(node) -> fx.Node | None:
    """W for `W.t()`, `W.T`, `W.mT`, `W.transpose(0, 1)`, `W.permute(1, 0)` of a 2-D tensor W."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_function" and node.target is getattr:
        name = node.args[1]
    if name not in _TRANSPOSES or not node.args:
        return None
    w = node.args[0]
    t = tensor_meta(w)
    if t is None or t.dim() != 2:
        return None
    dims = node.args[1:] if len(node.args) > 2 or name != "permute" else node.args[1]
    if name in ("transpose", "swapaxes", "swapdims") and sorted(d % 2 for d in dims[:2]) != [0, 1]:
        return None
    if name == "permute" and tuple(d % 2 for d in dims) != (1, 0):
        return None
    return w


def parameter_gemm(node: fx.Node, scopes: Scopes) -> ParameterGemm | None:
    """The node as y = x @ W.T (+ b) when it is a linear-shaped GEMM; a record with `problem` when it is a GEMM on
    a parameter in another form; None for anything else (no GEMM, or no operand read from a parameter)."""
    if is_linear(node):  # a linear by what the user wrote, whatever the weight is
        return ParameterGemm("linear", node.args[0], node_arg(node, 1, "weight"), NK, node_arg(node, 2, "bias"))
    if is_einsum(node):
        return _einsum(node, scopes)
    if is_addmm(node):
        bias, a, b = (node_arg(node, i, name) for i, name in enumerate(("input", "mat1", "mat2")))
        gemm = _product(node, a, b, scopes)
        if gemm is None or gemm.problem:
            return gemm
        bias_meta, n = tensor_meta(bias), tensor_meta(node)
        if set(node.kwargs) & {"beta", "alpha"} or bias_meta is None or bias_meta.dim() != 1 \
                or n is None or bias_meta.shape[0] != n.shape[-1]:
            return dataclasses.replace(gemm, problem=Reason(SkipCode.GEMM_FORM, "addmm with a scaled or "
                                       "non-vector input: not x @ W + b (not a linear form)"))
        return dataclasses.replace(gemm, bias=bias)
    if is_matmul(node) or is_batched_mm(node):
        args = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]  # `other=`, `mat2=`
        if _spelling(node) == "baddbmm":
            args = args[1:]
        if len(args) != 2:
            return None
        return _product(node, args[0], args[1], scopes)
    return None


def _is_weight(node, scopes: Scopes) -> bool:
    return isinstance(node, fx.Node) and weight_source(node, scopes) is not None


def _product(node: fx.Node, a: fx.Node, b: fx.Node, scopes: Scopes) -> ParameterGemm | None:
    """a @ b (matmul, mm, bmm, baddbmm's product) read as a linear on the parameter b."""
    spelling = _spelling(node)
    a_weight, b_weight = _is_weight(a, scopes), _is_weight(b, scopes)
    untransposed = transposed_2d(b)
    if not (a_weight or b_weight):
        return None  # activation @ activation: attention scores, not a GEMM on a weight
    problem = None
    if a_weight and b_weight:
        problem = Reason(SkipCode.GEMM_FORM, f"{spelling} of two parameters (a product of weights, not a layer's "
                                             "GEMM on activations): not a linear form")
    elif a_weight:
        problem = Reason(SkipCode.GEMM_FORM, f"{spelling} with the parameter on the left (W @ x): not a linear "
                                             "form (x @ W)")
    if problem:
        return ParameterGemm(spelling, a, b, problem=problem)
    x, w = tensor_meta(a), tensor_meta(b)
    if x is None or w is None:
        return ParameterGemm(spelling, a, b, problem=Reason(SkipCode.NO_METADATA, f"{spelling}: an operand has no "
                                                                                  "recorded tensor metadata"))
    if w.dim() >= 3 or spelling in ("bmm", "baddbmm"):
        return ParameterGemm(spelling, a, b, KN, problem=Reason(
            SkipCode.BATCHED_GEMM, f"{spelling} of x {tuple(x.shape)} by a stacked weight {tuple(w.shape)}: a "
                                   "batched product per expert or head"))
    if w.dim() != 2:
        return ParameterGemm(spelling, a, b, KN, problem=Reason(
            SkipCode.NOT_2D_WEIGHT, f"{spelling} by a {w.dim()}-D weight {tuple(w.shape)} (a matrix-vector "
                                    "product); expected a 2-D weight"))
    return ParameterGemm(spelling, a, untransposed, NK) if untransposed is not None else \
        ParameterGemm(spelling, a, b, KN)


# ---------------------------------------------------------------- einsum


def _einsum_operands(node: fx.Node) -> tuple[str, list]:
    equation, rest = node.args[0], list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    return equation, rest


def _letters(spec: str, ndim: int) -> list[str] | None:
    """An operand's subscripts, one per dim; `...` becomes as many of _DOTS (never einsum letters) as it spans."""
    if "..." not in spec:
        return list(spec) if len(spec) == ndim else None
    head, tail = spec.split("...")
    fill = ndim - len(head) - len(tail)
    return list(head) + list(_DOTS[:fill]) + list(tail) if 0 <= fill <= len(_DOTS) else None


def _einsum(node: fx.Node, scopes: Scopes) -> ParameterGemm | None:
    equation, operands = _einsum_operands(node)
    weights = [i for i, o in enumerate(operands) if _is_weight(o, scopes)]
    if not weights:
        return None
    if not isinstance(equation, str) or len(operands) != 2 or len(weights) != 1:
        return ParameterGemm("einsum", None, operands[weights[-1]], problem=Reason(
            SkipCode.GEMM_FORM, f"einsum {equation!r} of {len(operands)} operands, {len(weights)} of them "
                                "parameters: not a linear form (x times one weight)"))
    w_index = weights[0]
    x_node, w_node = operands[1 - w_index], operands[w_index]
    form = _einsum_form(equation, w_index, tensor_meta(x_node), tensor_meta(w_node))
    if isinstance(form, Reason):
        return ParameterGemm("einsum", x_node, w_node, problem=form)
    layout, x_order, n_dim = form
    return ParameterGemm("einsum", x_node, w_node, layout, None, x_order, n_dim)


def _einsum_form(equation: str, w_index: int, x, w) -> Reason | tuple:
    """(layout, x_order, n_dim) when `equation` is a linear of x by the 2-D weight, else the reason it is not."""
    shown = f"einsum {equation!r}"
    if x is None or w is None:
        return Reason(SkipCode.NO_METADATA, f"{shown}: an operand has no recorded tensor metadata")
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    specs = inputs.split(",")
    if len(specs) != 2:
        return Reason(SkipCode.GEMM_FORM, f"{shown}: not a linear form (two operands)")
    x_spec, w_spec = specs[1 - w_index], specs[w_index]
    xs, ws = _letters(x_spec, x.dim()), _letters(w_spec, w.dim())
    if xs is None or ws is None or "..." in w_spec:
        return Reason(SkipCode.GEMM_FORM, f"{shown}: the weight's subscripts broadcast (`...`): not a linear form")
    dots = [c for c in xs if c in _DOTS]
    if arrow:
        os = list(output.replace("...", "".join(dots)))
    else:  # implicit output: the broadcast dims, then the subscripts seen once, sorted
        os = dots + sorted(c for c in set(xs + ws) if c not in _DOTS and (xs + ws).count(c) == 1)
    if len(set(xs)) != len(xs) or len(set(ws)) != len(ws) or len(set(os)) != len(os):
        return Reason(SkipCode.GEMM_FORM, f"{shown}: a repeated subscript (a diagonal): not a linear form")
    batch = [c for c in ws if c in xs and c in os]
    if batch:
        return Reason(SkipCode.BATCHED_GEMM, f"{shown}: {''.join(batch)!r} indexes x, the weight {tuple(w.shape)} "
                                             "and the output: a batched product per head or expert")
    contracted = [c for c in ws if c in xs]
    free = [c for c in ws if c not in xs]
    if w.dim() != 2 or len(contracted) != 1 or len(free) != 1 or free[0] not in os \
            or set(os) != (set(xs) - set(contracted)) | set(free):
        return Reason(SkipCode.GEMM_FORM, f"{shown} with the weight {tuple(w.shape)}: not a linear form "
                                          "(x[..., K] times one [K, N] weight; here two contracted or summed "
                                          f"subscripts, or a weight of {w.dim()} dims)")
    (k,), (n,) = contracted, free
    layout = NK if ws == [n, k] else KN
    order = [xs.index(c) for c in os if c != n] + [xs.index(k)]
    x_order = None if order == list(range(len(xs))) else tuple(order)
    n_dim = None if os[-1] == n else os.index(n)
    return layout, x_order, n_dim
