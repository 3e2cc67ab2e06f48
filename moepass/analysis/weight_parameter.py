"""The parameter a GEMM's weight is read from, and where it sits: in the compiled frame and in the live model.

During a backend call Dynamo's graph input carries the parameter itself and its source (`L['self']._modules['head']
._parameters['weight']`); afterwards (a finder called on a kept graph) it keeps neither, and the parameter is found
again from its name and from where the graph's modules sit in the model (moepass.analysis.module_paths).
"""

from __future__ import annotations

import dataclasses
import operator
import re

from torch import fx, nn

from moepass.analysis.module_paths import normalize_module_path
from moepass.analysis.module_paths import WRAPPER_ATTRS, ModuleIndex, current

from .gemms import MAYBE, Scopes, gemm_operands, weight_source


@dataclasses.dataclass(frozen=True)
class WeightParameter:
    """The parameter a GEMM's weight is read from, and where it sits in the compiled frame and in the model."""

    node: fx.Node | None  # the graph input (placeholder or get_attr) of the top graph
    source: str | None  # its path from the compiled frame's local: `head.weight` for L['self']._modules['head']...
    path: str | None  # its state_dict name from the top of the model, where the live model is found
    value: nn.Parameter | None
    model: nn.Module | None  # the top of the model


def _squash(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _source(node: fx.Node) -> str | None:
    """The parameter's path from the frame's local: from Dynamo's source during a backend call; afterwards (Dynamo
    drops it) from the placeholder's name, matched to the frame's parameter names."""
    grapharg = node.meta.get("grapharg")
    name = getattr(getattr(grapharg, "source", None), "name", None)
    name = name() if callable(name) else name
    if name:
        keys = re.findall(r"\[['\"]([^'\"\]]+)['\"]\]", name)
        return ".".join(k for k in keys[1:] if k not in WRAPPER_ATTRS) if keys else None
    if node.op != "placeholder" or "_parameters_" not in node.name:
        return None
    guess = ".".join(re.split(r"_(?:modules|parameters)_", node.name)[1:]).rstrip("_")
    owner = node.graph.owning_module
    fqns = owner.meta.get("dynamo_flat_name_to_original_fqn", {}).values() if owner is not None else ()
    return next((f for f in fqns if _squash(f) == _squash(guess)), guess)


def _model_of(gm: fx.GraphModule | None, index: ModuleIndex) -> tuple[nn.Module | None, str | None]:
    """(the model, the path of the compiled frame's local in it) from the modules the graph's nodes came from."""
    for node in gm.graph.nodes if gm is not None else ():
        for key, (raw, _) in (node.meta.get("nn_module_stack") or {}).items():
            full, relative, lineage = index.path(key), normalize_module_path(raw), index.lineage(key)
            if full is not None and lineage and (full == relative or full.endswith("." + relative)):
                return lineage[-1], full[:len(full) - len(relative)].rstrip(".")
    return None, None


def weight_parameter(weight: fx.Node, scopes: Scopes, index: ModuleIndex) -> WeightParameter:
    node = weight_source(weight, scopes)
    if node is None or node is MAYBE:
        return WeightParameter(None, None, None, None, None)
    source, value = _source(node), None
    try:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(node.graph.owning_module)
        else:
            value = getattr(node.meta.get("grapharg"), "example", None)
    except Exception:  # noqa: BLE001  (a weak reference gone, an attribute renamed: the name is all there is)
        pass
    held = []  # (path, holder): a weight tied to an embedding has two
    for module, name in index.holders(value) if isinstance(value, nn.Parameter) else ():
        path = index.module_path(module)
        if path is not None:
            held.append((f"{path}.{name}" if path else name, module))
    if held:  # the holder the frame read it through, where that is one of them
        path, module = next(((p, m) for p, m in held if source and (p == source or p.endswith("." + source))),
                            held[0])
        return WeightParameter(node, source, path, value, index.top(module))
    model, local = _model_of(node.graph.owning_module, index)  # after the backend call: where the frame sits
    if model is None or source is None:
        return WeightParameter(node, source, None, None, model)
    path = f"{local}.{source}" if local else source
    try:
        value = model.get_parameter(path)
    except AttributeError:
        value = None
    return WeightParameter(node, source, path, value, model)


def module_by_weight(node: fx.Node) -> str:
    """A GEMM issued by its frame's own module (no enclosing module recorded: DeepSeek's head compiled as a frame of
    its own, `x @ self.w` in the model's forward) named by its weight: `head` for head.weight, the parameter's own
    name where the model holds it itself; '' when it reads no parameter."""
    gm = node.graph.owning_module
    scopes = Scopes(gm) if gm is not None else None
    for operand in gemm_operands(node) if scopes is not None else ():
        param = weight_parameter(operand, scopes, current())
        path = param.path or param.source
        if path:
            return path.removesuffix(".weight") if path != "weight" else path
    return ""
