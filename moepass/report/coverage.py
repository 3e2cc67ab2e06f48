"""Every GEMM left in a rewritten graph (and every opaque call reading a weight), accounted for, and the share of GEMM
work that runs in low precision.

After the passes ran, each GEMM node of the graph and of its HOP bodies is exactly one of:
    low_precision  a moepass GEMM op (moepass.op_registry), a GEMM already FP8 (torch._scaled_mm), or one a pass
                   left to torchao, which the user converted it with (skip code TORCHAO_CONVERTED; also torchao's
                   opaque GEMM calls, which are no GEMM node)
    bf16           a torch GEMM a low-precision GEMM pass (linear, grouped_mm) left alone, with its skip code
    not_weight     no operand is read from a parameter: activation @ activation (attention scores `q @ k.T`, SDPA);
                   listed, but outside the coverage: nothing to quantize a weight of
    unaccounted    a GEMM on a parameter that no pass rewrote or gave a reason for: a bug, shown, never dropped
An opaque call that reads a weight (moepass.analysis.opaque_ops: a custom op, an allow_in_graph autograd.Function) is
listed too: as its pass judged it where moepass reads it as the GEMM it is (transformers::grouped_mm_fallback), else
kept with code OPAQUE_WEIGHT_OP and a reason naming the op (its GEMMs are out of moepass's sight, and run as written).
FLOPs count a GEMM's forward and both backward GEMMs: 3 x 2*M*N*K (a grouped GEMM's M is its total rows; a symbolic
size by its hint, a data-dependent one by the rows an EP exchange sends, else Inductor's unbacked fallback).

Which nodes are GEMMs, and which operand is a weight: moepass.analysis.gemms. Tests set MOEPASS_STRICT_GEMMS=1
(tests/conftest.py), which makes an unaccounted GEMM fail the compile that found it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections import Counter

import torch
from torch import fx

from ..analysis.gemms import MAYBE, Scopes, gemm_kind, gemm_operands, parameter_name, weight_source
from ..analysis.opaque_grouped_mm import grouped_mm_op
from ..analysis.opaque_ops import OpaqueWeightRead, opaque_weight_read
from ..analysis.torchao_converted import torchao_conversion
from ..analysis.scopes import Scope
from ..analysis.symbols import backed_values
from ..analysis.graph import example_int, op_short_name, is_grouped_mm, op_name, tensor_meta
from ..analysis.node_module import module_path

try:  # Dynamo wraps backend errors in BackendCompilerFailed unless they are ShortenTraceback
    from torch._dynamo.exc import ShortenTraceback as _PassThrough
except ImportError:  # pragma: no cover
    _PassThrough = RuntimeError

log = logging.getLogger(__name__)

LOW_PRECISION, BF16, NOT_WEIGHT, UNACCOUNTED = "low_precision", "bf16", "not_weight", "unaccounted"
# BF16 reasons that are not a pass's skip code (moepass.skips): why each is BF16, and what to do about it
WGRAD_BF16 = "WGRAD_BF16"
PASS_OFF = "PASS_OFF"
NOT_SKIP_CODES = {
    WGRAD_BF16: ("a low-precision GEMM whose wgrad runs in BF16 (its FLOPs' third)", "`<recipe>.wgrad_bf16: false`"),
    PASS_OFF: ("the pass that rewrites this GEMM is not in the `passes` option", "add it to `passes`"),
}
STRICT_ENV = "MOEPASS_STRICT_GEMMS"
TORCHAO = "TORCHAO_CONVERTED"  # the skip code of a GEMM left to torchao: low precision, run by torchao's recipe
OPAQUE = "OPAQUE_WEIGHT_OP"  # the code of an opaque call reading a weight that no pass judged: listed, kept as is
_PRECISION_PASSES = ("linear", "grouped_mm", "both")  # a skip from these (or with a code of theirs) decides precision

@dataclasses.dataclass
class GemmUse:
    """One GEMM node of a rewritten graph and what became of it."""
    node: str  # its name, `<body>/<node>` inside a HOP body
    module: str  # module path of the node ('' at top level)
    weight: str  # the parameter it reads ("w1", "weight"), '' when none
    op: str  # "moepass.mxfp8_linear", "matmul", "einsum", "transformers.grouped_mm_fallback", ...
    status: str  # LOW_PRECISION, BF16, NOT_WEIGHT or UNACCOUNTED
    code: str = ""  # BF16: the skip code (SkipCode name; OPAQUE_WEIGHT_OP for an opaque call no pass judged)
    by: str = ""  # the pass that rewrote it or left it alone ('' when none)
    flops: int = 0  # forward + dgrad + wgrad
    lowp_flops: int = 0  # of those, run in low precision
    estimated: bool = False  # a size was data dependent: FLOPs rest on an expected or fallback value
    note: str = ""  # why it is where it is, when the status alone does not say

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class UnaccountedGemms(_PassThrough):
    """Raised under MOEPASS_STRICT_GEMMS when a graph holds a GEMM no pass accounts for."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.first_useful_frame = None  # read by Dynamo's ShortenTraceback handling


# ---------------------------------------------------------------- FLOPs


class _Sizes:
    """Sizes as ints: static, a backed symbol's hint, or for a data-dependent one the rows to expect."""

    def __init__(self, gm: fx.GraphModule):
        self._gm = gm
        self.estimated = False

    @functools.cached_property
    def _routed_rows(self):
        from ..analysis.routed_rows import RoutedRows

        return RoutedRows(self._gm)

    def fallback(self, node: fx.Node) -> int:
        try:
            expected = self._routed_rows.expected(node)
        except Exception:  # noqa: BLE001  (an estimate is not worth failing a report over)
            expected = None
        if expected is not None:
            return expected.rows
        from torch._inductor import config

        return int(config.unbacked_symint_fallback)

    def of(self, size, node: fx.Node) -> int:
        value = example_int(size)
        if value is not None:
            return value
        self.estimated = True
        expr, env = size.node.expr, size.node.shape_env
        fallback = self.fallback(node)
        hints = backed_values(env)
        return int(expr.xreplace({s: hints.get(s, fallback) for s in expr.free_symbols}))

    def shape(self, t: torch.Tensor, node: fx.Node) -> list[int]:
        return [self.of(s, node) for s in t.shape]


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def forward_flops(node: fx.Node, sizes: _Sizes) -> int:
    """2*M*N*K of one GEMM node's forward (a grouped GEMM: its total rows; einsum: every index it loops over)."""
    out = tensor_meta(node)
    ops = [tensor_meta(a) for a in gemm_operands(node)]
    if out is None or not ops:
        return 0
    shape = functools.partial(sizes.shape, node=node)
    if gemm_kind(node) == "sdpa":
        q, k, v = (shape(t) for t in ops[:3])
        return 2 * _prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    if op_short_name(node) == "einsum":
        return 2 * _einsum_loop_size(node.args[0], [shape(t) for t in ops])
    a, out_shape = shape(ops[0]), shape(out)
    if op_short_name(node) == "addbmm":
        return 2 * _prod(out_shape) * a[0] * a[-1]
    if is_grouped_mm(node) and len(a) == 2 and ops[1].dim() == 2:  # the wgrad form: groups split K, out [G, M, N]
        return 2 * _prod(out_shape[1:]) * a[-1]
    return 2 * _prod(out_shape) * a[-1]


def _einsum_loop_size(equation: str, shapes: list[list[int]]) -> int:
    """The product of every index's size (what a two-operand einsum multiplies and adds over)."""
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    size: dict[str, int] = {}
    for spec, shape in zip(inputs, shapes):
        if "..." in spec:
            head, tail = spec.split("...")
            batch = shape[len(head):len(shape) - len(tail)]
            size.update({f"...{i}": s for i, s in enumerate(reversed(batch))})
            spec, shape = head + tail, shape[:len(head)] + shape[len(shape) - len(tail):]
        size.update(zip(spec, shape))
    return _prod(size.values())


def _wgrad_bf16(node: fx.Node) -> bool:
    """A moepass forward op's wgrad_bf16 argument (its args end with (..., wgrad_bf16, kernel))."""
    return len(node.args) >= 2 and node.args[-2] is True


# ---------------------------------------------------------------- the census


@dataclasses.dataclass
class _Records:
    """What the passes recorded, by qualified node name."""
    skips: dict  # node -> (pass, skip code, reason), for skips that decide a GEMM's precision
    rewrites: dict  # node -> pass
    ran: set  # the passes that ran

    @classmethod
    def of(cls, passes) -> _Records:
        return cls({s.node: (p.name, s.code, s.reason) for p in passes for s in p.skipped
                    if _decides_precision(p.name, s.code)},
                   {r.node: p.name for p in passes for r in p.rewrites}, {p.name for p in passes})


def _decides_precision(pass_name: str, code) -> bool:
    """A skip of the low-precision GEMM passes: not another pass's (weights_before_gemm's, quantize_once's)."""
    return pass_name in _PRECISION_PASSES or any(p in str(getattr(code, "passes", "")) for p in _PRECISION_PASSES)


def census(gm: fx.GraphModule, passes) -> list[GemmUse]:
    """Every GEMM node left in `gm` (rewritten by `passes`, the pipeline's PassRecords) and what it is. Call inside
    module_paths.indexing() for full module paths. Never raises: a GEMM it cannot read is unaccounted, with why."""
    records, scopes, sizes = _Records.of(passes), Scopes(gm), _Sizes(gm)
    found = []
    for scope in (*scopes.entered, *scopes.unentered):
        if scope.kind.endswith("backward"):
            continue  # an autograd.Function's backward GEMMs: counted as its forward GEMMs' backward
        for node in scope.graph.nodes:
            kind, opaque = gemm_kind(node), None
            if kind is None and _skip_code(records, scope.qualified(node.name)) == TORCHAO:
                kind = "torchao"  # an opaque torchao GEMM call a pass listed
            if kind is None:
                opaque = _opaque_read(node, scopes)
                kind = None if opaque is None else "opaque"  # a custom op or autograd.Function reading a weight
            if kind is None:
                continue
            try:
                found.append(_use(node, kind, scope, scopes, sizes, records) if opaque is None else
                             _opaque_use(node, opaque, scope, scopes, sizes, records))
            except Exception as e:  # noqa: BLE001  (the census never fails a compile: the GEMM shows instead)
                found.append(GemmUse(scope.qualified(node.name), module_path(node), "", op_name(node), UNACCOUNTED,
                                     note=f"could not be read ({type(e).__name__}: {e})"))
    return found


def _skip_code(records: _Records, name: str) -> str:
    code = records.skips.get(name, (None, None, None))[1]
    return getattr(code, "name", str(code) if code is not None else "")


def _use(node: fx.Node, kind: str, scope: Scope, scopes: Scopes, sizes: _Sizes, records: _Records) -> GemmUse:
    name = scope.qualified(node.name)
    weight = next((w for w in (weight_source(a, scopes) for a in gemm_operands(node)) if w is not None), None)
    use = GemmUse(name, module_path(node), "" if weight in (None, MAYBE) else parameter_name(weight), op_name(node),
                  UNACCOUNTED)
    try:
        sizes.estimated = False
        use.flops = 3 * forward_flops(node, sizes) * scopes.runs(scope)
        use.estimated = sizes.estimated
    except Exception as e:  # noqa: BLE001  (a size it cannot read leaves the FLOPs at 0, said in the note)
        use.note = f"FLOPs unknown ({type(e).__name__}: {e})"
    owner = "grouped_mm" if is_grouped_mm(node) else "linear"  # the pass that rewrites a torch GEMM of its kind
    if kind in ("moepass", "scaled"):
        use.status, use.lowp_flops = LOW_PRECISION, use.flops
        use.by = records.rewrites.get(scope.qualified(node.meta.get("moepass_replaced", node.name)), "")
        if kind == "moepass" and _wgrad_bf16(node):
            use.lowp_flops, use.note = use.flops * 2 // 3, "wgrad in BF16 (wgrad_bf16)"
        if kind == "scaled":
            use.note = f"already low precision ({use.op}): not moepass's"
    elif name in records.skips:
        use.by, use.code = records.skips[name][0], _skip_code(records, name)
        use.status = BF16
        if use.code == TORCHAO:  # the user's own low precision: the reason names the torchao conversion
            use.status, use.lowp_flops, use.note = LOW_PRECISION, use.flops, records.skips[name][2]
    elif weight is None or kind == "sdpa":
        use.status = NOT_WEIGHT
    elif owner not in records.ran:
        use.status, use.code, use.note = BF16, PASS_OFF, f"the {owner} pass did not run (options['passes'])"
    elif scope in scopes.unentered:
        use.note = f"inside a {scope.kind} body, which the passes do not enter"
    return use


def _opaque_read(node: fx.Node, scopes: Scopes) -> OpaqueWeightRead | None:
    try:
        return opaque_weight_read(node, scopes)
    except Exception as e:  # noqa: BLE001  (a node it cannot read is no reason to fail the compile: logged)
        log.debug("coverage: could not tell whether %s reads a weight: %s", node.format_node(), e)
        return None


def _opaque_use(node: fx.Node, read: OpaqueWeightRead, scope: Scope, scopes: Scopes, sizes: _Sizes,
                records: _Records) -> GemmUse:
    """An opaque call reading a weight: as a pass recorded it, else kept as written with its reason (OPAQUE_WEIGHT_OP).
    FLOPs only where moepass knows the op's GEMM (a GROUPED_MM_OPS op: 2*M*N*K as for torch._grouped_mm)."""
    name = scope.qualified(node.name)
    use = GemmUse(name, module_path(node), parameter_name(read.weight), op_name(node), UNACCOUNTED)
    grouped = grouped_mm_op(node)
    if grouped is not None and grouped.mismatch is None:
        sizes.estimated = False
        use.flops = 3 * forward_flops(node, sizes) * scopes.runs(scope)
        use.estimated = sizes.estimated
    if name in records.skips:  # a pass judged it (the grouped_mm pass, as the torch._grouped_mm it computes)
        use.by, use.code, use.note = records.skips[name][0], _skip_code(records, name), records.skips[name][2]
        use.status = BF16
        if use.code == TORCHAO:
            use.status, use.lowp_flops = LOW_PRECISION, use.flops
    elif grouped is not None and grouped.mismatch is None and "grouped_mm" not in records.ran:
        use.status, use.code, use.note = BF16, PASS_OFF, "the grouped_mm pass did not run (options['passes'])"
    elif torchao_conversion(node) is not None and not {"linear", "grouped_mm"} <= records.ran:
        use.status, use.code = BF16, PASS_OFF  # an opaque torchao GEMM call: the pass that lists it did not run
        use.note = "the pass that lists torchao's GEMM calls (linear or grouped_mm) did not run (options['passes'])"
    else:
        use.status, use.code, use.note = BF16, OPAQUE, read.text()
        if grouped is not None and grouped.mismatch is not None:
            use.note += f" (not read as torch._grouped_mm: {grouped.mismatch})"
        elif scope in scopes.unentered:
            use.note += f" (inside a {scope.kind} body, which the passes do not enter)"
    return use


# ---------------------------------------------------------------- summing up


def coverage(uses: list[GemmUse], graphs: list[int] | None = None) -> dict:
    """GEMMs found (on weights), low precision, BF16 by skip code, unaccounted; the same for FLOPs; the
    low-precision share of weight GEMM FLOPs; not-weight GEMMs beside, outside the share. `graphs`: each use's
    graph index, named with the unaccounted ones."""
    graph_of = {id(u): g for u, g in zip(uses, graphs)} if graphs is not None else {}
    weight = [u for u in uses if u.status != NOT_WEIGHT]
    bf16 = Counter(u.code for u in weight if u.status == BF16)
    bf16_flops = Counter()
    for u in weight:
        if u.status == BF16:
            bf16_flops[u.code] += u.flops
        elif u.status == LOW_PRECISION and u.lowp_flops < u.flops:
            bf16_flops[WGRAD_BF16] += u.flops - u.lowp_flops
    total = sum(u.flops for u in weight)
    lowp = sum(u.lowp_flops for u in weight if u.status == LOW_PRECISION)
    unaccounted = [u for u in weight if u.status == UNACCOUNTED]
    unaccounted_codes = Counter(u.code for u in unaccounted if u.code)
    not_weight = [u for u in uses if u.status == NOT_WEIGHT]
    return {
        "gemms": len(weight),
        "low_precision": sum(u.status == LOW_PRECISION for u in weight),
        "bf16": dict(sorted(bf16.items())),
        "unaccounted": len(unaccounted),
        **({"unaccounted_by_code": dict(sorted(unaccounted_codes.items()))} if unaccounted_codes else {}),
        "not_weight": len(not_weight),
        "flops": {"total": total, "low_precision": lowp, "bf16": dict(sorted(bf16_flops.items())),
                  "unaccounted": sum(u.flops for u in unaccounted),
                  "not_weight": sum(u.flops for u in not_weight)},
        "low_precision_flop_share": round(lowp / total, 4) if total else None,
        "flops_estimated": sum(u.estimated for u in uses),
        "unaccounted_gemms": [{**({"graph": graph_of[id(u)]} if id(u) in graph_of else {}), "node": u.node,
                               "module": u.module, "op": u.op, "weight": u.weight,
                               **({"code": u.code} if u.code else {}),
                               **({"note": u.note} if u.note else {})} for u in unaccounted],
    }


def coverage_line(cov: dict) -> str:
    """One line: `19 weight GEMMs, 17 low precision, 2 BF16 (OUTPUT_HEAD 1, ROUTER_GATE 1), 0 unaccounted; 79.8% of
    their FLOPs in low precision (fwd+dgrad+wgrad); 2 activation GEMMs (attention) outside the share`."""
    bf16 = sum(cov["bf16"].values())
    reasons = f" ({', '.join(f'{k} {v}' for k, v in cov['bf16'].items())})" if bf16 else ""
    codes = cov.get("unaccounted_by_code", {})
    opaque = f" ({', '.join(f'{k} {v}' for k, v in codes.items())})" if codes else ""
    text = (f"{cov['gemms']} weight GEMMs, {cov['low_precision']} low precision, {bf16} BF16{reasons}, "
            f"{cov['unaccounted']} unaccounted{opaque}; {share_text(cov['low_precision_flop_share'])} of their FLOPs "
            "in low precision (fwd+dgrad+wgrad)")
    if cov["not_weight"]:
        text += f"; {cov['not_weight']} activation GEMMs (attention) outside the share"
    if cov["flops_estimated"]:
        text += f"; {cov['flops_estimated']} with data-dependent sizes (FLOPs estimated)"
    return text


def share_text(share: float | None) -> str:
    """A low-precision FLOP share as `93.1%`; `-` where there are no weight GEMMs."""
    return "-" if share is None else f"{share * 100:.1f}%"


def strict() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def check_accounted(uses: list[GemmUse]) -> None:
    """Under MOEPASS_STRICT_GEMMS (tests set it): raise when a GEMM is unaccounted. Otherwise the report shows it."""
    missing = [u for u in uses if u.status == UNACCOUNTED]
    if missing and strict():
        listed = "; ".join(f"{u.op} at {u.module or '<top>'} (node {u.node}, weight {u.weight or '?'})"
                           f"{' ' + u.note if u.note else ''}" for u in missing)
        opaque = sum(u.code == OPAQUE for u in missing)
        opaque = f" ({opaque} of them opaque ops reading one)" if opaque else ""
        raise UnaccountedGemms(f"moepass ({STRICT_ENV} is set): {len(missing)} GEMM(s) on a parameter that no pass "
                               f"rewrote or gave a reason for{opaque}: {listed}")
