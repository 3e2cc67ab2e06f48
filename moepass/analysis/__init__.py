"""Analysis of Dynamo graphs (HOP scopes, collectives, subgraph evaluation, EP regions, GEMMs), and the node-building
helpers the passes rewrite with (graph.replace_node / insert_call, emit.py), which change a graph only when called."""
