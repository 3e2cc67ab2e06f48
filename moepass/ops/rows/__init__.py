"""Row sums by index: moepass::segment_sum_rows, what the scatter-adds of routed rows back to tokens become."""

from . import segment_sum  # noqa: F401  (registers the op)
