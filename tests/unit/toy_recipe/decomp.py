"""The toy recipe's Inductor decompositions: none. Its ops reach the compiled graphs whole (Inductor fallbacks), where
the compiled-graph audit counts them; a recipe that decomposes its ops shows the aten GEMMs they leave instead
(Recipe.decomposed_gemms)."""

from __future__ import annotations


def roundtrip_decompositions() -> dict:
    """{OpOverload: decomposition} for compile_fx(..., decompositions=...): empty."""
    return {}
