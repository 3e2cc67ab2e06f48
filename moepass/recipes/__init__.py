"""What is common to the low-precision recipes: the Recipe type (base.py), the registry of recipes by name
(registry.py), the per-GEMM plan the linear and grouped_mm passes share (plan.py), and recipe="auto" with its measured
table (auto.py, auto_table.py). Each recipe itself is a folder, moepass/ops/lowp/<name>/, next to its ops.

Nothing is imported here: `import moepass.recipes.registry` loads every built-in recipe (and registers its ops).
"""
