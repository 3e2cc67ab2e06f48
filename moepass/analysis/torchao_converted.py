"""GEMMs a user converted with torchao before compiling: how each conversion shows in the Dynamo graph.

- `quantize_(model, MXFP8TrainingOpConfig | Float8TrainingOpConfig)` (torchao.prototype.moe_training) swaps the
  parameters' data for a training-weight tensor subclass that holds the config. Dynamo keeps the plain
  `torch._grouped_mm` / `F.linear` node; only the weight operand's example value is the subclass. torchao's
  `__torch_function__` turns the GEMM into its own autograd function when AOTAutograd traces the graph.
- Float8Linear (`convert_to_float8_training`) and MXFP8Linear (torchtitan's MXFP8 converter) call autograd
  functions torchao marks `allow_in_graph`. Each is one opaque call, `trampoline_autograd_apply`, whose closure
  holds the Function class. Float8Linear passes its Float8LinearConfig among the call's constants.
- torchao's `nonstrict_trace` GEMM wrappers, called directly (`_to_mxfp8_then_scaled_grouped_mm`), are one
  opaque `flat_apply_capture` call. Its first operand is a `get_attr` of a callable wrapping that function.

Nothing here imports torchao: a value is torchao's when its class comes from a `torchao.` module.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import torch
from torch import fx

from moepass.analysis.scopes import Scope, graph_scopes
from moepass.analysis.graph import example_value, is_gemm
from moepass.analysis.node_module import module_path
from moepass.skips import Reason, SkipCode

# torchao's GEMM autograd functions and wrappers by name (mx_mm, _MXFP8GroupedMM, matmul_with_hp_or_float8_args,
# _Int8MixedPrecisionTrainingLinearFunction); its non-GEMM ones (permute, a2a_dispatch, casts) do not match
_GEMM_NAME = re.compile(r"mm(_|$)|matmul|linear", re.IGNORECASE)
_MM_CONFIGS = ("LinearMMConfig", "ScaledMMConfig")  # per-GEMM settings Float8Linear passes besides its config
# what MoE training's weight wrappers take over in __torch_function__ (torchao prototype/moe_training/tensor.py);
# any other op on such a weight runs in BF16 on the unwrapped tensor
_WRAPPER_GEMMS = ("_grouped_mm", "linear", "mm", "matmul", "addmm")


def _is_torchao(obj) -> bool:
    """A class, function or instance defined in torchao."""
    module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", None)
    return isinstance(module, str) and module.startswith("torchao.")


def _weight_conversion(value) -> str | None:
    """The torchao config (or tensor class) of a tensor-subclass value, looking inside a DTensor's local shard."""
    value = getattr(value, "_local_tensor", value)
    if not isinstance(value, torch.Tensor) or not _is_torchao(value):
        return None
    config = getattr(value, "config", None)
    return type(config).__name__ if _is_torchao(config) else type(value).__name__


def _wrapped(fn, depth: int = 3):
    """The callables a callable wraps: its closure's contents, `func`, `_fn` (flat_apply's callable) and
    `__wrapped__`, a few levels down."""
    if depth == 0:
        return
    inner = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner.append(cell.cell_contents)
        except ValueError:  # an empty cell (a variable not yet assigned)
            pass
    for attr in ("func", "_fn", "__wrapped__"):
        try:
            inner.append(getattr(fn, attr, None))
        except Exception:  # noqa: BLE001  (an object whose lookup fails wraps nothing to find)
            pass
    for f in inner:
        if callable(f):
            yield f
            yield from _wrapped(f, depth - 1)


def _torchao_gemm_function(node: fx.Node):
    """The torchao GEMM function or autograd.Function class an opaque call runs, or None."""
    if node.op != "call_function":
        return None
    callables = [node.target]
    first = node.args[0] if node.args else None
    if isinstance(first, fx.Node) and first.op == "get_attr":  # flat_apply's wrapped function
        owner = first.graph.owning_module
        callables.append(getattr(owner, str(first.target), None) if owner is not None else None)
    for fn in callables:
        for inner in (fn, *_wrapped(fn)):
            if _is_function(inner) and _is_torchao(inner) and _GEMM_NAME.search(inner.__name__):
                return inner
    return None


def _is_function(obj) -> bool:
    """A Python function or an autograd.Function class (not a config class a graph constructs, LinearMMConfig)."""
    if isinstance(obj, type):
        return issubclass(obj, torch.autograd.Function)
    return inspect.isfunction(obj)


def _constant_class(arg) -> type:
    """The class of a call's constant argument; Dynamo builds a dataclass constant in the graph (`Config(...)`)."""
    if isinstance(arg, fx.Node):
        return arg.target if arg.op == "call_function" and isinstance(arg.target, type) else fx.Node
    return type(arg)


def _call_conversion(node: fx.Node, fn) -> str:
    """Name an opaque torchao GEMM call: its torchao config, else its torchao module (MXFP8Linear), else the
    function."""
    classes = [_constant_class(a) for a in (*node.args, *node.kwargs.values())]
    configs = [c.__name__ for c in classes if _is_torchao(c) and c.__name__.endswith("Config")
               and c.__name__ not in _MM_CONFIGS]
    if configs:
        return configs[-1]
    stack = node.meta.get("nn_module_stack") or {}
    module_cls = list(stack.values())[-1][1] if stack else None
    if module_cls is not None and _is_torchao(module_cls):
        return getattr(module_cls, "__name__", str(module_cls))
    return fn.__name__


def torchao_conversion(obj: fx.Node | torch.Tensor) -> str | None:
    """The torchao conversion that runs this GEMM (its config's name: "MXFP8TrainingOpConfig",
    "Float8LinearConfig", or the module / tensor class where there is no config), or None when torchao does not.

    A node counts when it is an opaque call to a torchao GEMM function, or a GEMM with a torchao tensor-subclass
    operand that the subclass runs itself (MoE training's weight wrappers take only the GEMMs of `_WRAPPER_GEMMS`);
    a tensor counts when it is such a subclass. Pure."""
    if not isinstance(obj, fx.Node):
        return _weight_conversion(obj)
    fn = _torchao_gemm_function(obj)
    if fn is not None:
        return _call_conversion(obj, fn)
    if not is_gemm(obj):
        return None
    for operand in obj.all_input_nodes:
        value = example_value(operand)
        name = _weight_conversion(value)
        if name is not None:
            return name if _wrapper_takes(obj, value) else None
    return None


def _wrapper_takes(node: fx.Node, value) -> bool:
    """Whether a MoE-training weight wrapper runs this GEMM in low precision (other torchao subclasses: always)."""
    if not _is_torchao(getattr(getattr(value, "_local_tensor", value), "config", None)):
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")  # `@`: "matmul"
    if name == "_grouped_mm":
        return node.kwargs.get("offs") is not None  # the wrappers read offs from the keywords only
    return name in _WRAPPER_GEMMS


@dataclasses.dataclass
class TorchaoGemmCall:
    """An opaque call into a torchao GEMM: no GEMM node a pass would match, so passes list it from here."""

    node: fx.Node
    scope: Scope
    module: str
    conversion: str
    kind: str  # "grouped" or "linear": which low-precision pass lists it


def find_torchao_gemm_calls(gm: fx.GraphModule) -> list[TorchaoGemmCall]:
    """Every opaque torchao GEMM call in the graph and its HOP bodies. Pure."""
    found = []
    for scope in graph_scopes(gm):
        for node in scope.graph.nodes:
            fn = _torchao_gemm_function(node)
            if fn is not None:
                kind = "grouped" if "grouped" in fn.__name__.lower() else "linear"
                found.append(TorchaoGemmCall(node, scope, module_path(node), _call_conversion(node, fn), kind))
    return found


def left_to_torchao(node: fx.Node, config) -> Reason | None:
    """Why a GEMM torchao runs is left to it; None when torchao does not run it, or when the user handed such
    GEMMs to moepass (`lowp.take_over_torchao`) and this one can be taken (a tensor-subclass weight)."""
    conversion = torchao_conversion(node)
    if conversion is None:
        return None
    opaque = _torchao_gemm_function(node) is not None
    take_over = config.section("lowp").take_over_torchao
    if take_over and not opaque:
        return None
    text = f"converted by torchao ({conversion}): left to it"
    if take_over:
        text += " (an opaque torchao call: lowp.take_over_torchao reaches tensor-subclass weights only)"
    return Reason(SkipCode.TORCHAO_CONVERTED, text)


def taken_from_torchao(node: fx.Node) -> str:
    """The note a rewrite of a torchao-converted GEMM carries ("" for any other GEMM)."""
    conversion = torchao_conversion(node)
    return f" (overrode torchao's {conversion}: lowp.take_over_torchao)" if conversion else ""


def skip_torchao_gemm_calls(gm: fx.GraphModule, kind: str, config, record) -> None:
    """List the opaque torchao GEMM calls of `kind` ("grouped" or "linear") as left to torchao in `record`."""
    for call in find_torchao_gemm_calls(gm):
        if call.kind == kind:
            with record.in_scope(call.scope):
                record.skip(call.node, call.module, left_to_torchao(call.node, config))
