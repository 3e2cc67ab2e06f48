"""moepass/harness/variants.py: variant names -> backends and options, checked before any model is built."""

import pytest

from moepass.harness import variants
from moepass.options import DEFAULT_PASSES, PASS_NEEDS, PIPELINE


def test_variants_map_to_backends_and_passes():
    vs = {v.name: v for v in variants.resolve_variants(variants.variant_names(), {"mxfp8.wgrad_bf16": True})}
    assert vs["eager"].backend is None and vs["inductor"].backend == "inductor"
    assert vs["inductor"].options is None
    for name in PIPELINE:
        passes = [*PASS_NEEDS.get(name, ()), name]  # quantize_once rewrites grouped_mm's ops: its variant runs both
        assert vs[name].backend == "moepass" and vs[name].options == {"mxfp8.wgrad_bf16": True, "passes": passes}
    assert vs["all"].options["passes"] == list(DEFAULT_PASSES)
    assert "deepep" in variants.default_variant_names(ep=2) and "deepep" not in variants.default_variant_names(ep=1)


def test_old_pass_names_are_variants_running_the_renamed_pass():
    from moepass.options import Config

    old, new = variants.resolve_variants(["mxfp8_grouped_mm", "grouped_mm"])
    assert old.name == "mxfp8_grouped_mm" and old.options == {"passes": ["mxfp8_grouped_mm"]}
    assert Config.from_options(old.options).pipeline == Config.from_options(new.options).pipeline == ("grouped_mm",)
    assert variants.default_variant_names(ep=1) == ["inductor", "grouped_mm", "linear", "all"]


def test_unknown_variant_or_bad_options_fail_before_any_work():
    with pytest.raises(ValueError, match="unknown variant"):
        variants.resolve_variants(["inductor", "fp4"])
    with pytest.raises(ValueError, match="mxfp8.kernel"):
        variants.resolve_variants(["all"], {"mxfp8.kernel": "fast"})


def test_custom_variants_layer_their_options_over_the_shared_ones():
    custom = dict(variants.parse_custom_variant(s) for s in
                  ['wgrad_bf16={"mxfp8.wgrad_bf16": true}', 'linear_only={"passes": ["mxfp8_linear"]}'])
    vs = {v.name: v for v in variants.resolve_variants(["inductor", "all"], {"mxfp8.scale_rounding": "floor"}, custom)}
    assert list(vs) == ["inductor", "all", "wgrad_bf16", "linear_only"]
    assert vs["wgrad_bf16"].options == {"passes": list(DEFAULT_PASSES), "mxfp8.scale_rounding": "floor",
                                        "mxfp8.wgrad_bf16": True}
    assert vs["linear_only"].options["passes"] == ["mxfp8_linear"]
    assert "mxfp8.wgrad_bf16" not in vs["all"].options


@pytest.mark.parametrize("spec, match", [("noequals", "LABEL=JSON"), ("x=[1]", "LABEL=JSON"), ("=", "LABEL=JSON"),
                                         ("x={bad", "Expecting")])
def test_custom_variant_spec_errors_say_the_form(spec, match):
    with pytest.raises(ValueError, match=match):
        variants.parse_custom_variant(spec)


def test_custom_variant_cannot_shadow_a_name_or_carry_bad_options():
    with pytest.raises(ValueError, match="built-in"):
        variants.resolve_variants(["inductor"], None, {"all": {}})
    with pytest.raises(ValueError, match="mxfp8.kernel"):
        variants.resolve_variants(["inductor"], None, {"fast": {"mxfp8.kernel": "fast"}})
