"""The rewrites that run inside Inductor, after the pass pipeline hands it the graph: moepass.pipeline.INDUCTOR_STAGE
lists them in the order they run (joint graph, partition, post-grad audit)."""
