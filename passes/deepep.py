"""deepep: expert-parallel all-to-all regions -> moepass::ep_dispatch / ep_combine.

Not implemented yet (tracked as its own issue): this pass currently finds nothing and
rewrites nothing, and says so in the report when the graph holds all-to-alls.
"""

from __future__ import annotations

from torch import fx

NAME = "deepep"
SUMMARY = "EP all-to-all dispatch/combine regions -> DeepEP dispatch/combine (not yet implemented)"


def run(gm: fx.GraphModule, example_inputs, config, record) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and "all_to_all" in str(node.target):
            record.skip(node, "", "deepep pass not implemented yet: all-to-all left as is")
