"""What moepass did to each graph, and why not: records (records.py) filled by the passes with their skip codes
(moepass.skips), the coverage census (coverage.py), the per-run collection (collect.py), and what is written or logged
from them (files.py, collapse.py, left_alone.py, torch_logs.py). Nothing here changes a graph."""
