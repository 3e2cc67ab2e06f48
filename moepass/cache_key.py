"""Keeps the compile caches honest about moepass's own code.

A custom op's Python body and autograd formula are not part of Inductor's FX-graph cache key
or the AOTAutograd cache key, so after editing an op a warm cache could serve the old
kernel. Inductor does hash the `uuid()` of custom graph passes in its config, so we install a
no-op post-grad pass whose uuid is a hash of every moepass source file.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    import moepass
    import moepass.passes

    roots = {pathlib.Path(moepass.__file__).parent, pathlib.Path(moepass.passes.__file__).parent}
    digest = hashlib.sha256()
    for root in sorted(roots):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class SourceHashPass(CustomGraphPass):
    """Does nothing to the graph; exists for its uuid()."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"moepass-{source_hash()}"
