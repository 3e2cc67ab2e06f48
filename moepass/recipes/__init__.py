"""What is common to the low-precision recipes: the Recipe type (base.py), the registry of recipes by name
(registry.py), the per-GEMM plan the linear and grouped_mm passes share (plan.py), and recipe="auto" with its measured
table (auto.py, auto_table.py). Each recipe itself is a folder, moepass/ops/lowp/<name>/, next to its ops.

Nothing is imported here, and nothing here imports a recipe: each built-in recipe registers itself from its folder,
which `import moepass` imports (through moepass.ops).
"""
