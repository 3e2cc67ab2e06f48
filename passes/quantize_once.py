"""quantize_once: expert GEMMs read their rows quantized once, before the gather that routes them.

An expert's input rows are a gather of token rows (`x[token_of_slot]`, `x.index_select(0, idx)`; under EP, of the
rows a dispatch received), and the recipe's quantization of x (per row along K: fp8_rowwise's one scale per row,
blockwise's 1x128 tiles) commutes with a gather of rows. So this pass quantizes the gather's source once
(moepass::<recipe>_quantize_rows, which Inductor fuses into the source's producer), gathers the FP8 rows and their
scales along the same chain of gathers, and runs the expert GEMM as moepass::<recipe>_grouped_mm_rows on them: T rows
quantized instead of T * top_k, once for w1 and w3 alike, half the bytes gathered, and FP8 rows saved for the
backward instead of BF16 ones (ops/lowp/grouped_mm_rows.py says what that means for the wgrad). The forward and the
dgrad are bit-equal to the grouped_mm pass's ops. GEMMs whose input is no gather get the rows form too (x quantized
where it is, saved in FP8 once for w1 and w3). Under autocast the rows may be float32 and cast to bfloat16 after the
gather (`x[idx].bfloat16()`, as torchtitan's experts write it): the cast commutes with the gather, so the T token rows
are cast once, quantized, and then gathered.

Under expert parallelism the source is the rows moepass::ep_dispatch received (the deepep pass ran). When nothing but
such GEMMs reads those rows (through gathers) and they keep FP8 rows for the backward, the quantization moves before
the dispatch: moepass::ep_dispatch_quantized sends the FP8 rows and their scales instead of BF16 rows (half the
bytes), the experts read what arrives, and no quantization runs on the received rows (whose count, known only at run
time, keeps Inductor from fusing it). The combine and every gradient stay BF16, as in DeepSeek-V3. On DeepEP the rows
go as DeepEP's FP8 tokens, (e4m3 [T, H], fp32 [T, H/128]): blockwise's 1x128 tiles are that layout, fp8_rowwise's one
scale a row is that layout with the scale repeated (exact); other scales stay BF16 with the reason.

Runs after grouped_mm, on its ops (fp8_rowwise's and blockwise's; mxfp8's have no rows form, their kernels quantize x
themselves); a GEMM it cannot serve stays as grouped_mm left it, with the reason.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx

from moepass.analysis.dtensors import is_dtensor
from moepass.analysis.evaluate import reads_only_metadata
from moepass.analysis.row_gathers import gathered_from
from moepass.analysis.scopes import graph_scopes
from moepass.analysis.emit import Emitter
from moepass.analysis.graph import example_value, replace_node, tensor_meta
from moepass.analysis.node_module import module_path
from moepass.analysis.swiglu import swiglu_rows_of
from moepass.op_registry import GemmRole, gemm_role, is_quantize_rows, is_rows_form, quantize_rows_form, rows_form
from moepass.ops.ep import deepep
from moepass.skips import Reason, SkipCode

NAME = "quantize_once"

log = logging.getLogger(__name__)

_GROUPED_FORWARD = GemmRole("grouped", "forward")
# value-preserving steps real models put between the gather and the GEMM: torchtitan's `routed_input.bfloat16()` and
# transformers' `.to(torch.bfloat16)` on rows that are BF16 already, `.contiguous()`
_IDENTITIES = {"to", "bfloat16", "type_as", "contiguous", "clone", torch.Tensor.contiguous, torch.clone}


def same_rows_as(node: fx.Node) -> fx.Node | None:
    """The input of `node` when `node` is a copy or a same-dtype cast of it (the same values, shape and dtype)."""
    if node.op not in ("call_function", "call_method") or node.target not in _IDENTITIES or not node.args:
        return None
    source, out = node.args[0], tensor_meta(node)
    src = tensor_meta(source)
    if src is None or out is None or src.dtype != out.dtype or tuple(src.shape) != tuple(out.shape):
        return None
    if node.target == "to" and any(not isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return None  # a device move or a memory-format change: not these rows' bytes, leave it
    return source


def run(gm: fx.GraphModule, config, record) -> None:
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
                    _or_leave(scope.graph, node, record, _rewrite, scope.graph, node, form, config, record, quantized)
                    alive = set(scope.graph.nodes)  # after a failed rewrite: forget the nodes it took back
                    for key in [k for k, (q, scale, _) in quantized.items() if q not in alive or scale not in alive]:
                        del quantized[key]
            for quant in [n for n in scope.graph.nodes if n.op == "call_function" and is_quantize_rows(n.target)]:
                _or_leave(scope.graph, quant, record, _move_before_dispatch, scope.graph, quant, record)
            if config.section("quantize_once").swiglu_inputs == "fp8":
                for quant in [n for n in scope.graph.nodes
                              if n.op == "call_function" and is_quantize_rows(n.target)]:
                    _or_leave(scope.graph, quant, record, _fuse_swiglu, scope.graph, quant, record)


def _or_leave(graph: fx.Graph, node: fx.Node, record, rewrite, *args) -> None:
    """rewrite(*args), or on an unexpected error the nodes it added and nobody reads removed and the error reported
    against `node` (its checks run before it changes what existing nodes read)."""
    before = set(graph.nodes)
    try:
        rewrite(*args)
    except Exception as error:  # a moepass problem never fails the user's compile
        log.warning("quantize_once: left %s alone: %r", node.name, error, exc_info=True)
        for added in reversed([n for n in graph.nodes if n not in before]):
            if not added.users:
                graph.erase_node(added)
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
    saved_fp8 = _keeps_fp8_rows(config.section("quantize_once").saved_rows, form, wgrad_bf16)
    new = replace_node(graph, node, form.grouped_mm.default, (x, q, scale, w_t, offs, saved_fp8, *rest))
    where = f"quantized before {gathers} gather(s) of rows" if gathers else "quantized where they are"
    saved = "FP8 rows saved for the wgrad" if saved_fp8 else "BF16 rows saved for the wgrad"
    record.replace(node, module, f"moepass.{new.target.name().split('::')[-1]}", f"rows {where}; {saved}")


def _keeps_fp8_rows(saved_rows: str, form, wgrad_bf16) -> bool:
    """quantize_once.saved_rows for one GEMM. "auto" keeps FP8 rows wherever the wgrad keeps its precision on them
    (a BF16 wgrad, or a recipe whose FP8 wgrad re-quantizes them exactly); where FP8 rows would turn the recipe's FP8
    wgrad into a BF16 one (blockwise), it keeps BF16 rows and the wgrad is the grouped op's, bit for bit."""
    if saved_rows == "auto":
        return wgrad_bf16 is True or form.fp8_wgrad_on_rows
    return saved_rows == "fp8"


def _quantized_rows(emit: Emitter, x: fx.Node, form, settings: tuple, kernel: str, quantized: dict,
                    cast: bool = False):
    """(q, scale) nodes of x's rows (of x cast to bfloat16 when `cast`), and how many gathers they were moved
    before: quantize the source of x's chain of row gathers (and casts), then replay each gather on q and scale
    (nodes shared with every GEMM reading the same rows)."""
    key = (x, settings, kernel, cast)
    if key in quantized:
        return quantized[key]
    same = same_rows_as(x)
    widened = bf16_rows_of(x)
    if widened is not None and gathered_from(widened) is None and same_rows_as(widened) is None:
        widened = None  # no gather to move the cast before: the cast rows are quantized where they are
    if same is not None or widened is not None:  # a no-op cast, or a cast to bf16 (which commutes with a gather)
        result = _quantized_rows(emit, same if same is not None else widened, form, settings, kernel, quantized,
                                 cast or same is None)
        quantized[key] = result
        return result
    found = gathered_from(x)
    if found is None:
        source = emit("detach", x, method=True)  # a quantization has no gradient: the GEMM's x carries it
        if cast:  # float32 rows under autocast: cast once, here, before any gather
            source = emit("to", source, torch.bfloat16, method=True)
        quant = emit(form.quantize.default, source, *settings, kernel)
        result = (emit(operator.getitem, quant, 0), emit(operator.getitem, quant, 1), 0)
    else:
        source, index = found
        q, scale, gathers = _quantized_rows(emit, source, form, settings, kernel, quantized, cast)
        result = (emit(operator.getitem, q, index), emit(operator.getitem, scale, index), gathers + 1)
    quantized[key] = result
    return result


def bf16_rows_of(node: fx.Node) -> fx.Node | None:
    """The float32 rows `node` casts to bfloat16 (`x.bfloat16()`, `x.to(torch.bfloat16)`, as models running their
    grouped GEMMs under autocast write it), same shape; else None."""
    if node.op != "call_method" or node.target not in ("to", "bfloat16", "type_as") or not node.args:
        return None
    source, out = node.args[0], tensor_meta(node)
    src = tensor_meta(source)
    if src is None or out is None or src.dtype != torch.float32 or out.dtype != torch.bfloat16 \
            or tuple(src.shape) != tuple(out.shape):
        return None
    if node.target == "to" and any(not isinstance(a, torch.dtype) for a in (*node.args[1:], *node.kwargs.values())):
        return None  # a device move or a memory-format change: not these rows' bytes, leave it
    return source


# ---------------------------------------------------------------- the SwiGLU making the rows


def _fuse_swiglu(graph: fx.Graph, quant: fx.Node, record) -> None:
    """quant = <recipe>_quantize_rows(detach(x)) with x = silu(gate) * up (times a routing-weight column, as
    weights_before_gemm leaves it) read only by rows-form GEMMs keeping FP8 rows -> <recipe>_swiglu_rows(gate, up,
    weight): the same rows and scales, gate and up kept in FP8 for the backward, and a gradient carrier in x's place
    (ops/lowp/swiglu_rows.py)."""
    detach = quant.args[0]
    x = detach.args[0] if isinstance(detach, fx.Node) and detach.target == "detach" else None
    found = swiglu_rows_of(x) if isinstance(x, fx.Node) else None
    if found is None:
        return
    gate, up, weight, chain = found.gate, found.up, found.weight, found.chain
    module = module_path(x) or module_path(quant)
    problem = _swiglu_problem(quant, detach, gate, up, chain)
    if problem:
        record.skip(x, module, Reason(SkipCode.SWIGLU_STAYS_BF16, f"SwiGLU inputs stay BF16: {problem}"))
        return
    emit = Emitter(graph, example_value(gate).fake_mode)
    with graph.inserting_before(x):
        fused = emit(quantize_rows_form(quant.target).swiglu.default, gate, up, weight, *quant.args[1:])
        carrier, q, scale = (emit(operator.getitem, fused, i) for i in range(3))
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in x.meta:
            fused.meta[key] = x.meta[key]
    for user in list(quant.users):  # getitem(quant, 0) and (quant, 1)
        user.replace_all_uses_with(q if user.args[1] == 0 else scale)
        graph.erase_node(user)
    graph.erase_node(quant)
    graph.erase_node(detach)
    x.replace_all_uses_with(carrier)  # the GEMMs' x: the rows' gradient flows back through the fused op
    for node in reversed(chain):
        graph.erase_node(node)
    weighted = " and the routing weights" if weight is not None else ""
    record.replace(fused, module, f"moepass.{fused.target.name().split('::')[-1]}",
                   f"SwiGLU{weighted} fused with the rows' quantization; gate and up kept in FP8 for its backward")


def _swiglu_problem(quant, detach, gate, up, chain) -> str | None:
    """Why chain (gate and up to x = chain[-1]) cannot become the fused op, or None."""
    x = chain[-1]
    if quantize_rows_form(quant.target).swiglu is None:
        return f"{quant.target.name()}'s recipe has no fused SwiGLU"
    metas = [tensor_meta(n) for n in (gate, up, x)]
    if any(m is None for m in metas):
        return "no recorded tensor metadata"
    if any(m.dtype != torch.bfloat16 or len(m.shape) != 2 or tuple(m.shape) != tuple(metas[0].shape) for m in metas):
        return f"gate, up and the rows must be bfloat16 [M, K]; got {[(m.dtype, tuple(m.shape)) for m in metas]}"
    if set(detach.users) != {quant} or any(u.target is not operator.getitem for u in quant.users):
        return "the quantized rows are read other than as the GEMM's operand"
    for user in x.users:
        takes_rows = is_rows_form(user.target) and user.args[0] is x and x not in user.args[1:] \
            and user.args[5] is True
        if user is not detach and not takes_rows:
            return f"{x.name} is read by {user.name}, not only by expert GEMMs keeping FP8 rows"
    inside = set(chain)
    for node in chain[:-1]:
        if not set(node.users) <= inside:
            return f"{node.name} (inside the SwiGLU) is read elsewhere"
    for name, node in (("gate", gate), ("up", up)):
        if not set(node.users) <= inside:
            return f"{name} ({node.name}) is read elsewhere too, so its BF16 values are kept anyway"
    return None


# ---------------------------------------------------------------- before an EP dispatch


def _move_before_dispatch(graph: fx.Graph, quant: fx.Node, record) -> None:
    """quant = <recipe>_quantize_rows(detach(recv_x)) on the rows an ep_dispatch received -> the dispatch sends x's
    FP8 rows and scales (ep_dispatch_quantized), whose received ones replace quant's outputs."""
    detach = quant.args[0]
    recv_x = detach.args[0] if isinstance(detach, fx.Node) and detach.target == "detach" else None
    dispatch = recv_x.args[0] if isinstance(recv_x, fx.Node) and recv_x.target is operator.getitem \
        and recv_x.args[1] == 0 else None
    if not isinstance(dispatch, fx.Node) or dispatch.target is not torch.ops.moepass.ep_dispatch.default:
        return
    module = module_path(dispatch) or module_path(quant)
    problem = _bf16_readers(recv_x, detach) or _backend_problem(dispatch.args[-1], quant)
    if problem:
        record.skip(dispatch, module, Reason(SkipCode.DISPATCH_STAYS_BF16, f"dispatch sends BF16: {problem}"))
        return
    value = example_value(dispatch)
    emit = Emitter(graph, getattr(value[0], "fake_mode", None))
    with graph.inserting_before(dispatch):
        x = dispatch.args[0]
        quantized = emit(quant.target, emit("detach", x, method=True), *quant.args[1:])
        x_q, x_scale = emit(operator.getitem, quantized, 0), emit(operator.getitem, quantized, 1)
        sent = graph.call_function(torch.ops.moepass.ep_dispatch_quantized.default,
                                   (x, x_q, x_scale, *dispatch.args[1:]))
        _dispatch_meta(sent, dispatch, x_q, x_scale)
        recv_q, recv_scale = (emit(operator.getitem, sent, i) for i in (1, 2))
    for user in list(dispatch.users):  # getitem(dispatch, i): recv_x stays output 0, the rest move up by two
        user.args = (sent, user.args[1] if user.args[1] == 0 else user.args[1] + 2)
    for user in list(quant.users):
        user.replace_all_uses_with(recv_q if user.args[1] == 0 else recv_scale)
        graph.erase_node(user)
    graph.erase_node(quant)
    if not detach.users:
        graph.erase_node(detach)
    graph.erase_node(dispatch)
    h, s = tensor_meta(x_q).shape[1], tensor_meta(x_scale).shape[1]
    backend = dispatch.args[-1]
    if backend == "deepep":  # DeepEP carries one scale per 128 columns (a row's one scale repeated)
        s = h // deepep.FP8_SCALE_BLOCK
    record.replace(sent, module, "moepass.ep_dispatch_quantized",
                   f"FP8 rows and their scales sent through {backend} ({h + 4 * s} bytes a row instead of {2 * h}); "
                   "the experts read them as received")


def _backend_problem(backend: str, quant: fx.Node) -> str | None:
    """Why the dispatch's backend cannot send the rows as `quant` quantizes them, or None: DeepEP takes FP8 rows with
    one fp32 scale per 128 columns (blockwise's tiles; fp8_rowwise's row scale, repeated), the reference any."""
    if backend != "deepep":
        return None
    value = example_value(quant)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return "backend 'deepep': the quantized rows have no recorded metadata"
    q, scale = value
    reason = deepep.fp8_scales_unsupported_reason(q.shape[1], scale.shape[1], scale.dtype)
    return f"backend 'deepep': {reason}" if reason else None


def _bf16_readers(rows: fx.Node, detach: fx.Node) -> str | None:
    """What reads the values of `rows` other than rows-form GEMMs keeping FP8 rows (as their gradient carrier, through
    row gathers) and the quantization's detach; None when nothing does."""
    for user in rows.users:
        if user is detach or reads_only_metadata(user, rows):  # zeros_like(rows), rows.size(0): no values read
            continue
        found = gathered_from(user)
        passes_rows = (found is not None and found[0] is rows and rows not in user.args[1:]
                       and rows not in user.kwargs.values()) or same_rows_as(user) is rows
        if passes_rows:
            problem = _bf16_readers(user, detach)
            if problem:
                return problem
        elif is_rows_form(user.target) and user.args[0] is rows and rows not in user.args[1:]:
            if user.args[5] is not True:
                return (f"{user.name} keeps BF16 rows for its wgrad (quantize_once.saved_rows 'bf16', or 'auto' "
                        "under a recipe whose FP8 wgrad needs them)")
        else:
            return f"{user.name} ({user.target if isinstance(user.target, str) else user.target.__name__}) reads them"
    return None


def _dispatch_meta(sent: fx.Node, dispatch: fx.Node, x_q: fx.Node, x_scale: fx.Node) -> None:
    """ep_dispatch_quantized's value: ep_dispatch's, with the received FP8 rows and scales sized by the same
    (unbacked) received-row count, so every value read off the dispatch keeps its shapes and symbols."""
    value = example_value(dispatch)
    recv_x, q, scale = value[0], tensor_meta(x_q), tensor_meta(x_scale)
    with recv_x.fake_mode:
        recv_q = recv_x.new_empty((recv_x.shape[0], q.shape[1]), dtype=q.dtype)
        recv_scale = recv_x.new_empty((recv_x.shape[0], scale.shape[1]), dtype=scale.dtype)
    sent.meta.update({k: v for k, v in dispatch.meta.items() if k not in ("example_value", "unbacked_bindings")})
    sent.meta["example_value"] = (recv_x, recv_q, recv_scale, *value[1:])
    bindings = dispatch.meta.get("unbacked_bindings")
    if bindings:  # paths into the outputs: every output after recv_x is two further on
        sent.meta["unbacked_bindings"] = {sym: _shifted(path) for sym, path in bindings.items()}


def _shifted(path: tuple) -> tuple:
    from torch.utils._pytree import SequenceKey

    first = path[0]
    if isinstance(first, SequenceKey) and first.idx > 0:
        return (SequenceKey(first.idx + 2), *path[1:])
    return path
