"""Whether a graph's GEMM weights are gathered by FSDP2 for the step and resharded after it.

FSDP2 (`fully_shard`, as torchtitan applies it per block) all-gathers a block's weights before its forward and
frees them after, gathering again for the backward. Anything the compiled graph saves for the backward that is
computed from a gathered weight (an FP8 copy quantized once for forward and dgrad) stays alive in between, a whole
weight per block: the recipes' "auto" options turn such sharing off there. `fully_shard` swaps a module's class for
a subclass of FSDPModule, so the test is the class of the modules a graph's nodes were issued from, and of theirs.
"""

from __future__ import annotations

from torch import fx

from moepass.analysis import module_paths
from moepass.analysis.scopes import graph_scopes


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def weights_sharded(gm: fx.GraphModule) -> bool:
    """Some module the graph's nodes came from (or one above it) is sharded by FSDP2. Needs the live modules:
    call it inside module_paths.indexing() (the backend's pipeline call)."""
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return False
    keys = {key for scope in graph_scopes(gm) for n in scope.graph.nodes
            for key in (n.meta.get("nn_module_stack") or {})}
    return any(isinstance(m, fsdp) for key in keys for m in module_paths.lineage(key))
