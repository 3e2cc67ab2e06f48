"""Calls moepass cannot look into that read a weight: any GEMM inside them is unseen by the passes.

Which calls are opaque (`opaque_op`):
- a custom op (`torch.ops.<lib>.<op>`, an OpOverload or its packet) of a library that is not torch's own or moepass's;
- an autograd.Function Dynamo keeps whole (`allow_in_graph`: one `trampoline_autograd_apply` call);
- a `torch._dynamo.nonstrict_trace` function (one `flat_apply` call) or any other Python function outside torch;
- a higher-order op with no body graph to walk (a user Triton kernel). A body that Dynamo traced (activation
  checkpoint, an inlined autograd.Function, cond) is walked instead: what runs inside it is judged there.
Which reads count (`weight_read`): a parameter of 2 or more dims, a matrix or a stack of them, read through views,
casts and slices (moepass.analysis.gemms.weight_source). Not counted, since they hold no GEMM moepass could take:
torch's own ops (embedding lookups, norms, convolutions, FSDP's copy-ins, DTensor and collectives), moepass's ops,
and any op on a 1-D parameter (a norm's scale, a bias, a router's expert bias). A read seen only through the input of
a body moepass does not enter (a cond branch) is not counted either: there the walk cannot tell a weight.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch import fx, nn

from .gemms import Scopes, parameter_name, weight_source
from .graph import example_value

# libraries whose ops are torch's own (a read of a weight there is an embedding, a copy, a gather) or moepass's
TORCH_LIBRARIES = frozenset({"aten", "prims", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd",
                             "c10d", "_dtensor", "fsdp", "profiler", "moepass"})
_PYTHON_MODULES = ("torch", "_operator", "operator", "builtins", "math")  # functions there are torch's or Python's
# einops' layout functions move a weight's dims about (Dynamo keeps them whole before einops 0.8.2); einsum is a GEMM
_EINOPS_LAYOUT = frozenset({"rearrange", "repeat", "reduce", "pack", "unpack", "parse_shape"})


@dataclasses.dataclass(frozen=True)
class OpaqueWeightRead:
    """An opaque call and the weight it reads."""

    op: str  # "transformers::grouped_mm_fallback", "autograd.Function mylib.FusedLinear", ...
    weight: fx.Node  # the parameter, as the graph holds it (a placeholder or get_attr)
    shape: tuple  # the parameter's shape

    def text(self) -> str:
        """The reason the census shows (moepass.skips.SkipCode.OPAQUE_WEIGHT_OP's phrase leads it)."""
        return (f"opaque op {self.op} reads weight {parameter_name(self.weight)} {list(self.shape)}: moepass cannot "
                "see its GEMMs")


def opaque_op(node: fx.Node) -> str | None:
    """The name of the opaque callable `node` calls; None for anything moepass can see through or knows."""
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = target._qualified_op_name if isinstance(target, torch._ops.OpOverloadPacket) else \
            target.overloadpacket._qualified_op_name
        return None if name.split("::")[0] in TORCH_LIBRARIES else name
    hop = isinstance(target, torch._ops.HigherOrderOperator)
    name = target.name() if hop else getattr(target, "__name__", "")
    if "flat_apply" in name:  # nonstrict_trace (a flat_apply HOP, or Dynamo's flat_apply_capture): the function is
        return f"nonstrict_trace function {_wrapped_function(node) or '?'}"  # the callable its first operand fetches
    if hop:
        if any(isinstance(_attribute(a), fx.GraphModule) for a in node.args):
            return None  # a traced body: walked, its calls judged one by one
        return f"higher-order op {name}"
    if name == "trampoline_autograd_apply":  # an allow_in_graph autograd.Function: its class is in the closure
        function_class = _autograd_function(target)
        return None if _python_or_torch(function_class) else f"autograd.Function {_qualified(function_class)}"
    if isinstance(target, type) or not callable(target) or _python_or_torch(target):
        return None  # a constant's constructor (a config dataclass), torch's functions, Tensor methods, operators
    if str(target.__module__).startswith("einops") and name in _EINOPS_LAYOUT:
        return None
    return _qualified(target)


def _python_or_torch(obj) -> bool:
    """Defined by torch or Python itself (or of no known module: a Tensor method descriptor)."""
    module = getattr(obj, "__module__", None)
    return not isinstance(module, str) or module.split(".")[0] in _PYTHON_MODULES


def weight_read(node: fx.Node, scopes: Scopes) -> tuple[fx.Node, tuple] | None:
    """The first parameter of 2 or more dims that `node` reads (through views, casts, slices), with its shape."""
    for operand in node.all_input_nodes:
        source = weight_source(operand, scopes)
        if not isinstance(source, fx.Node):
            continue  # an activation, or an input the walk cannot follow (MAYBE)
        shape = _shape(source)
        if shape is not None and len(shape) >= 2:
            return source, shape
    return None


def opaque_weight_read(node: fx.Node, scopes: Scopes) -> OpaqueWeightRead | None:
    """`node` as an opaque call reading a weight, or None."""
    op = opaque_op(node)
    if op is None:
        return None
    read = weight_read(node, scopes)
    return None if read is None else OpaqueWeightRead(op, *read)


def _attribute(arg):
    """The object a get_attr node fetches from its graph's module; None for anything else."""
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        return None
    owner = arg.graph.owning_module
    try:
        return operator.attrgetter(str(arg.target))(owner) if owner is not None else None
    except AttributeError:
        return None


def _autograd_function(target):
    """The autograd.Function class a `trampoline_autograd_apply` (Dynamo's call of an allow_in_graph Function)
    runs, from its closure; None for any other target."""
    for cell in getattr(target, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, type) and issubclass(value, torch.autograd.Function):
            return value
    return None


def _wrapped_function(node: fx.Node) -> str | None:
    """The user function a flat_apply call runs: its first operand fetches a callable that wraps it (in Dynamo's own
    functions, a few levels down)."""
    frontier = [_attribute(node.args[0]) if node.args else None]
    for _ in range(4):
        inner = []
        for fn in frontier:
            if callable(fn) and not isinstance(fn, type) and not str(getattr(fn, "__module__", "")).startswith("torch"):
                return _qualified(fn)
            inner += [getattr(fn, a, None) for a in ("_fn", "func", "__wrapped__")]
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    inner.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
        frontier = [f for f in inner if callable(f)]
    return None


def _qualified(obj) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None) or \
        getattr(obj, "__name__", None) or type(obj).__name__
    return f"{module}.{name}" if module else str(name)


def _shape(parameter: fx.Node) -> tuple | None:
    value = example_value(parameter)
    if value is None and parameter.op == "get_attr":
        value = _attribute(parameter)
    if isinstance(value, (torch.Tensor, nn.Parameter)):
        return tuple(value.shape)
    return None
