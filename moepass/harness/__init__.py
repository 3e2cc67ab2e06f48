"""The benchmark harness: `moepass bench`, `moepass converge`, their charts, the training step and the corpus.

Kept apart from the engine so that the compile-cache key (moepass.inductor_stage.cache_key.source_hash) leaves it out:
editing a chart or a table must not invalidate compiled graphs.
"""
