"""New graph nodes with the FakeTensor values Dynamo would have recorded, so later passes read their shapes."""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch.fx.node import map_arg

from moepass.analysis.graph import example_value

log = logging.getLogger(__name__)


class Emitter:
    """Inserts call nodes before an anchor, with the FakeTensor values later passes read."""

    def __init__(self, graph: fx.Graph, fake_mode):
        self.graph, self.fake_mode = graph, fake_mode

    def __call__(self, target, *args, method: bool = False, **kwargs) -> fx.Node:
        node = (self.graph.call_method if method else self.graph.call_function)(target, args, kwargs)
        fake_value(node, self.fake_mode)
        return node


def fake_value(node: fx.Node, fake_mode) -> None:
    """(Re)compute a node's FakeTensor value from its inputs' values; drop it when that is not possible."""
    node.meta.pop("example_value", None)
    if fake_mode is None or any(example_value(a) is None for a in node.all_input_nodes):
        return
    args, kwargs = map_arg((node.args, node.kwargs), example_value)
    try:  # identity hooks: a user's saved-tensor hooks (activation offloading) must not see fake tensors
        with fake_mode, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            value = getattr(args[0], node.target)(*args[1:], **kwargs) if node.op == "call_method" \
                else node.target(*args, **kwargs)
    except Exception as error:  # a later pass then sees no metadata and says so; AOTAutograd retraces anyway
        log.debug("no fake value for %s: %r", node.name, error, exc_info=True)
        return
    node.meta["example_value"] = value
    _bind_unbacked(fake_mode, node, value)


def _bind_unbacked(fake_mode, node, value) -> None:
    """Claim the unbacked sizes a fake kernel just made, as Dynamo does for the nodes it traces."""
    from torch.fx.experimental.symbolic_shapes import compute_unbacked_bindings

    if fake_mode.shape_env is not None:
        bindings = compute_unbacked_bindings(fake_mode.shape_env, value)
        if bindings:
            node.meta["unbacked_bindings"] = bindings
