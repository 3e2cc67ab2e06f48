"""Custom ops that compute torch._grouped_mm under another name, read as the grouped GEMM they are.

HF transformers 5.x runs its grouped_mm experts through its own custom op, `transformers::grouped_mm_fallback(input,
weight, offs)`, wherever torch._grouped_mm cannot run under torch.compile (weights not in BF16: FP32 or FP16 models,
autocast over FP32 masters). Its body loops `torch.mm(input[start:end], weight[i])` over group-end offsets, opaque to
the passes. `read_as_grouped_mm` turns each such node into `torch._grouped_mm(x, w, offs=offs)` for the grouped_mm
pass to judge like any other; the ones it leaves alone get their own op back, and their reasons name it.

An op is taken for torch._grouped_mm only where the two agree on sample inputs of the node's dtypes and weight layout
(forward, and both gradients through the op's own backward), checked at compile time once per op, dtypes and layout.
Where they do not, or the op fails on them, the node stays as it is and `mismatch` says why. Rows past the last
offset are not compared: the fallback zeroes them, torch._grouped_mm leaves them unwritten (transformers masks them).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import fx

from .graph import example_int, node_arg, tensor_meta
from .scopes import Scope, graph_scopes

# qualified op name -> its arguments' names for torch._grouped_mm's (x [M, K], w [E, K, N], offs [E] group ends)
GROUPED_MM_OPS = {"transformers::grouped_mm_fallback": ("input", "weight", "offs")}
_SAMPLE_GROUPS = (4, 0, 8)  # rows per expert: an empty group between two
_SAMPLE_K, _SAMPLE_N = 16, 8  # 16-byte aligned rows in every dtype torch._grouped_mm takes


@dataclasses.dataclass
class GroupedMmOp:
    """A call of a custom op that computes torch._grouped_mm(x, w, offs=offs)."""

    node: fx.Node
    scope: Scope
    op: str  # its qualified name, "transformers::grouped_mm_fallback"
    x: fx.Node
    w: fx.Node
    offs: fx.Node
    mismatch: str | None  # why it is not taken for torch._grouped_mm; None when it is


def grouped_mm_op_name(node: fx.Node) -> str | None:
    """The qualified name of a GROUPED_MM_OPS op `node` calls (OpOverload or its packet, as Dynamo holds it)."""
    target = node.target if node.op == "call_function" else None
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    name = getattr(target, "_qualified_op_name", None) if isinstance(target, torch._ops.OpOverloadPacket) else None
    return name if name in GROUPED_MM_OPS else None


def grouped_mm_op(node: fx.Node, scope: Scope | None = None) -> GroupedMmOp | None:
    """`node` read as a grouped GEMM (with `mismatch` set where it is not one), or None for any other node."""
    name = grouped_mm_op_name(node)
    if name is None:
        return None
    x, w, offs = (node_arg(node, i, arg) for i, arg in enumerate(GROUPED_MM_OPS[name]))
    return GroupedMmOp(node, scope, name, x, w, offs, mismatch(name, x, w, offs))


def find_grouped_mm_ops(gm: fx.GraphModule) -> list[GroupedMmOp]:
    """Every GROUPED_MM_OPS call in the graph and the HOP bodies the passes enter."""
    return [found for scope in graph_scopes(gm) for n in scope.graph.nodes
            if (found := grouped_mm_op(n, scope)) is not None]


def mismatch(name: str, x, w, offs) -> str | None:
    """Why `name(x, w, offs)` is not taken for torch._grouped_mm(x, w, offs=offs); None when it is."""
    metas = [tensor_meta(a) for a in (x, w, offs)]
    if any(m is None for m in metas):
        return "its operands have no recorded tensor metadata"
    xm, wm, om = metas
    if (xm.dim(), wm.dim(), om.dim()) != (2, 3, 1) or om.dtype not in (torch.int32, torch.int64):
        return (f"operands {xm.dim()}-D, {wm.dim()}-D and {om.dim()}-D {om.dtype}: not x[M,K], w[E,K,N] and "
                "integer offs[E]")
    return sample_mismatch(name, xm.dtype, wm.dtype, om.dtype, _dim_order(wm))


def _dim_order(t: torch.Tensor) -> tuple[int, ...]:
    """t's dims from the outermost in memory to the innermost (a transposed weight: (0, 2, 1))."""
    strides = [example_int(s) for s in t.stride()]
    if any(s is None for s in strides):
        return tuple(range(t.dim()))
    return tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))


@functools.cache
def sample_mismatch(name: str, x_dtype, w_dtype, offs_dtype, w_order: tuple[int, ...]) -> str | None:
    """Run the op and torch._grouped_mm on the same small random inputs (a generator of their own: the user's random
    stream is untouched) and compare outputs and both gradients."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    generator = torch.Generator().manual_seed(0)
    experts, rows = len(_SAMPLE_GROUPS), sum(_SAMPLE_GROUPS)
    offs = torch.tensor(_SAMPLE_GROUPS, dtype=torch.int64).cumsum(0).to(offs_dtype)
    x = torch.randn(rows, _SAMPLE_K, generator=generator).to(x_dtype)
    stored = [(experts, _SAMPLE_K, _SAMPLE_N)[d] for d in w_order]  # w as it lies in memory, then viewed as the node's
    w = torch.randn(stored, generator=generator).to(w_dtype).permute([w_order.index(d) for d in range(3)])
    grad = torch.randn(rows, _SAMPLE_N, generator=generator).to(x_dtype)
    packet = functools.reduce(getattr, name.split("::"), torch.ops)
    try:
        with unset_fake_temporarily(), torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast("cpu", enabled=False):
            theirs = _run(lambda a, b: packet(a, b, offs), x, w, grad)
            ours = _run(lambda a, b: torch._grouped_mm(a, b, offs=offs.to(torch.int32)), x, w, grad)
    except Exception as e:  # noqa: BLE001  (an op that cannot run on sample inputs is not taken for a grouped GEMM)
        return f"it failed on sample inputs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    for what, a, b in zip(("output", "input gradient", "weight gradient"), theirs, ours):
        try:
            torch.testing.assert_close(a, b)
        except AssertionError:
            return (f"its {what} differs from torch._grouped_mm's on sample inputs ({x_dtype}, max difference "
                    f"{(a.float() - b.float()).abs().max().item():.3g})")
    return None


def _run(gemm, x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """gemm(x, w) and the gradients of x and w for the upstream gradient `grad`."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    out = gemm(x, w)
    dx, dw = torch.autograd.grad(out, (x, w), grad)
    return out.detach(), dx, dw


@dataclasses.dataclass
class ReadAsGroupedMm:
    """The nodes `read_as_grouped_mm` turned into torch._grouped_mm, with what each called before."""

    taken: list[tuple[GroupedMmOp, tuple]] = dataclasses.field(default_factory=list)

    def restore_left_alone(self, record) -> None:
        """Give each node still a torch._grouped_mm (the pass left it alone) its own op back, and name the op in the
        reason `record` holds for it; a rewrite's detail names the op it replaced."""
        for match, (target, args, kwargs) in self.taken:
            qualified = match.scope.qualified(match.node.name)
            said = f"{match.op} read as torch._grouped_mm"
            if match.node in match.scope.graph.find_nodes(op="call_function", target=torch._grouped_mm):
                match.node.target, match.node.args, match.node.kwargs = target, args, kwargs
                for skip in record.skipped:
                    if skip.node == qualified:
                        skip.reason = f"{said}: {skip.reason}"
            for rewrite in record.rewrites:
                if rewrite.node == qualified:
                    rewrite.detail = f"{rewrite.detail} ({said})".lstrip()


def read_as_grouped_mm(gm: fx.GraphModule) -> ReadAsGroupedMm:
    """Turn every GROUPED_MM_OPS call that computes torch._grouped_mm into one, in place (its name and metadata
    stay); `restore_left_alone` undoes it for the ones the pass then leaves alone."""
    taken = ReadAsGroupedMm()
    for match in find_grouped_mm_ops(gm):
        if match.mismatch is not None:
            continue  # stays opaque: the coverage census lists it with the mismatch
        node = match.node
        taken.taken.append((match, (node.target, node.args, node.kwargs)))
        node.target, node.args, node.kwargs = torch._grouped_mm, (match.x, match.w), {"offs": match.offs}
    return taken
