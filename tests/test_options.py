"""Options are validated up front; a bad key or value names the valid ones."""

import pytest
import torch

from moepass.options import OPTIONS, PIPELINE, Config, OptionsError, options_table_markdown


def test_defaults_run_every_pass_in_pipeline_order():
    config = Config.from_options(None)
    assert config.pipeline == PIPELINE
    assert config["mxfp8.scale_rounding"] == "rceil"
    assert config["mxfp8.keep_router_bf16"] and config["mxfp8.keep_output_head_bf16"]


def test_pass_selection_keeps_pipeline_order():
    config = Config.from_options({"passes": ["mxfp8_linear", "mxfp8_grouped_mm"]})
    assert config.pipeline == ("mxfp8_grouped_mm", "mxfp8_linear")
    assert not config.enabled("deepep")


@pytest.mark.parametrize("options, names", [
    ({"mxfp8.exlude": ["x"]}, ["mxfp8.exclude", "passes"]),
    ({"mxfp8.scale_rounding": "nearest"}, ["rceil", "floor"]),
    ({"passes": ["mxfp8"]}, ["mxfp8_linear", "deepep"]),
    ({"mxfp8.wgrad_bf16": "yes"}, ["True", "False"]),
    ({"mxfp8.exclude": "output"}, ["list of glob"]),
])
def test_bad_options_raise_value_error_naming_valid_ones(options, names):
    with pytest.raises(ValueError) as info:
        Config.from_options(options)
    for name in names:
        assert name in str(info.value)


def test_bad_option_reaches_torch_compile_caller_as_value_error():
    model = torch.nn.Linear(32, 32)
    compiled = torch.compile(model, backend="moepass", options={"no_such_option": 1})
    with pytest.raises(ValueError, match="unknown option.*Valid options"):
        compiled(torch.randn(4, 32))


def test_options_table_lists_every_option():
    table = options_table_markdown()
    assert all(f"`{o.key}`" in table for o in OPTIONS)
    assert issubclass(OptionsError, ValueError)


def test_readme_options_table_is_the_generated_one():
    import pathlib

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    assert options_table_markdown() in readme, "README options table is stale: paste the output of `moepass options`"
