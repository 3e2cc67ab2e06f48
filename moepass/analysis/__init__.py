"""Read-only analysis of Dynamo graphs: HOP scopes, collectives, subgraph evaluation, EP regions."""
