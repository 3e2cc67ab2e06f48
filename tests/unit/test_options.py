"""Options are validated up front; a bad key or value names the valid ones."""

import re

import pytest
import torch

from moepass.options import (DEFAULT_PASSES, PIPELINE, Config, Lowp, OptionsError, options_table,
                             options_table_markdown)

OPTIONS = options_table()


def test_defaults_run_the_default_passes_in_pipeline_order():
    config = Config.from_options(None)
    assert config.pipeline == DEFAULT_PASSES == PIPELINE
    assert config["mxfp8.scale_rounding"] == "rceil"
    assert config["lowp.keep_router_bf16"] and config["lowp.keep_output_head_bf16"]


def test_pass_selection_keeps_pipeline_order():
    config = Config.from_options({"passes": ["linear", "grouped_mm"]})
    assert config.pipeline == ("grouped_mm", "linear")
    assert not config.enabled("deepep")


# ---------------------------------------------------------------- old names (before the recipe-neutral ones)


def test_old_pass_names_select_the_same_passes():
    with pytest.warns(DeprecationWarning, match="pass name 'mxfp8_linear' is deprecated; use 'linear'"):
        old = Config.from_options({"passes": ["mxfp8_linear", "mxfp8_grouped_mm"]})
    assert old.pipeline == ("grouped_mm", "linear") and old["passes"] == ("linear", "grouped_mm")  # new names only
    assert old.enabled("mxfp8_linear") and old.enabled("linear") and not old.enabled("deepep")
    with pytest.warns(DeprecationWarning, match="'mxfp8_linear'"):
        both = Config.from_options({"passes": ["linear", "mxfp8_linear"]})
    assert both["passes"] == ("linear",)  # one pass, named twice


def test_old_pass_names_load_the_renamed_pass_modules():
    from moepass.pipeline import load_pass

    assert load_pass("mxfp8_linear") is load_pass("linear") and load_pass("linear").NAME == "linear"
    assert load_pass("mxfp8_grouped_mm").NAME == "grouped_mm"


@pytest.mark.parametrize("old, new, value", [
    ("mxfp8.include", "lowp.include", ["layers.*"]),
    ("mxfp8.exclude", "lowp.exclude", ["output"]),
    ("mxfp8.keep_router_bf16", "lowp.keep_router_bf16", False),
    ("mxfp8.keep_output_head_bf16", "lowp.keep_output_head_bf16", False),
])
def test_old_option_keys_set_the_new_ones(old, new, value):
    with pytest.warns(DeprecationWarning, match=rf"option '{old}' is deprecated; use '{new}'"):
        config = Config.from_options({old: value})
    assert config.values == Config.from_options({new: value}).values
    with pytest.warns(DeprecationWarning, match=rf"use '{new}'"):
        assert old not in config.to_dict() and config[old] == config[new] != Config.from_options(None)[new]
    with pytest.raises(OptionsError, match=rf"{old}.*{new}|{new}.*{old}"), pytest.warns(DeprecationWarning):
        Config.from_options({old: value, new: value})  # one option given twice


def test_old_option_keys_are_checked_like_the_new_ones():
    with pytest.raises(OptionsError, match="'lowp.exclude'='output' is not valid; expected a list of glob"), \
            pytest.warns(DeprecationWarning):
        Config.from_options({"mxfp8.exclude": "output"})


@pytest.mark.parametrize("options, names", [
    ({"lowp.exlude": ["x"]}, ["lowp.exclude", "passes"]),
    ({"mxfp8.scale_rounding": "nearest"}, ["rceil", "floor"]),
    ({"passes": ["mxfp8"]}, ["linear", "deepep", "mxfp8_linear"]),
    ({"mxfp8.wgrad_bf16": "yes"}, ["True", "False"]),
    ({"lowp.exclude": "output"}, ["list of glob"]),
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


def test_options_table_lists_every_option_under_its_new_name_only():
    table = options_table_markdown()
    assert all(f"`{o.key}`" in table for o in OPTIONS)
    assert not any(alias in table for o in OPTIONS for alias in o.aliases)  # old names work, but are not listed
    assert issubclass(OptionsError, ValueError)


def test_docs_options_table_is_the_generated_one():
    import itertools
    import pathlib

    lines = (pathlib.Path(__file__).parents[2] / "docs" / "options.md").read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if "<!-- options-table" in line), len(lines))
    table = "\n".join(itertools.takewhile(lambda line: line.startswith("|"), lines[start + 1:]))
    assert table == options_table_markdown(), (
        "docs/options.md's table is stale: replace it (the lines after its `options-table` marker) with the output of "
        "`python -c 'from moepass.options import options_table_markdown as t; print(t())'`")


# ---------------------------------------------------------------- options checked before any pass runs


def test_options_not_a_dict_name_the_fix():
    with pytest.raises(OptionsError, match=r"options must be a dict of option names to values, not list") as info:
        Config.from_options(["passes"])
    assert "'lowp.exclude'" in str(info.value)  # the valid names are listed
    compiled = torch.compile(torch.nn.Linear(32, 32), backend="moepass", options=["passes"])
    with pytest.raises(OptionsError, match="must be a dict"):
        compiled(torch.randn(4, 32))


def test_unknown_option_suggests_the_near_name():
    with pytest.raises(OptionsError, match=r"did you mean \['lowp.exclude'\]"):
        Config.from_options({"lowp.exlude": ["x"]})


def test_report_dir_is_created_and_left_clean(tmp_path):
    target = tmp_path / "a" / "b"
    config = Config.from_options({"report_dir": target})  # a Path is fine too
    assert config["report_dir"] == str(target)
    assert target.is_dir() and list(target.iterdir()) == []


def test_report_dir_that_is_a_file_fails_before_any_pass(tmp_path, monkeypatch):
    import moepass.pipeline

    a_file = tmp_path / "report.txt"
    a_file.write_text("")
    with pytest.raises(OptionsError) as info:
        Config.from_options({"report_dir": str(a_file)})
    message = str(info.value)
    assert "'report_dir'" in message and str(a_file) in message and "File exists" in message
    assert "give a directory" in message
    monkeypatch.setattr(moepass.pipeline, "run_pipeline",
                        lambda *a: pytest.fail("a pass ran before report_dir was checked"))
    compiled = torch.compile(torch.nn.Linear(32, 32), backend="moepass", options={"report_dir": str(a_file)})
    with pytest.raises(OptionsError, match="report_dir"):
        compiled(torch.randn(4, 32))


def test_report_dir_that_cannot_be_created_names_the_os_error(tmp_path):
    a_file = tmp_path / "report.txt"
    a_file.write_text("")
    # tests run as root, which chmod does not stop: a path under a file cannot be created by anyone
    with pytest.raises(OptionsError, match=r"'report_dir'=.*report.txt/sub.*Not a directory"):
        Config.from_options({"report_dir": str(a_file / "sub")})


def test_empty_report_dir_is_refused():
    with pytest.raises(OptionsError, match="'report_dir'='' is not valid; expected a directory path or None"):
        Config.from_options({"report_dir": ""})


# ---------------------------------------------------------------- Inductor mode and options


def test_inductor_modes_are_torchs():
    from moepass.options import INDUCTOR_MODES

    assert set(INDUCTOR_MODES) == set(torch._inductor.list_mode_options())


def test_inductor_mode_then_inductor_options_in_the_patches():
    from moepass.backend import inductor_patches

    mode = "max-autotune-no-cudagraphs"
    config = Config.from_options({"inductor.mode": mode, "inductor.options": {"coordinate_descent_tuning": False,
                                                                              "triton.unique_kernel_names": True}})
    patches = inductor_patches(config)
    assert patches["max_autotune"] is True  # from the mode
    assert patches["coordinate_descent_tuning"] is False  # inductor.options wins over the mode
    assert patches["triton.unique_kernel_names"] is True
    assert set(patches) == set(torch._inductor.list_mode_options(mode)) | {"triton.unique_kernel_names"}
    assert inductor_patches(Config.from_options(None)) == {}


def test_torch_compile_mode_without_options_still_applies():
    from moepass.backend import inductor_patches

    config = Config.from_options(None, mode="reduce-overhead")
    assert config["inductor.mode"] == "reduce-overhead"
    assert inductor_patches(config) == torch._inductor.list_mode_options("reduce-overhead")


def test_mode_and_inductor_mode_must_agree():
    agreed = Config.from_options({"inductor.mode": "max-autotune"}, mode="max-autotune")
    assert agreed["inductor.mode"] == "max-autotune"
    with pytest.raises(OptionsError, match=r"mode='max-autotune' and option 'inductor.mode'='default' disagree"):
        Config.from_options({"inductor.mode": "default"}, mode="max-autotune")
    with pytest.raises(OptionsError, match=r"mode='fast' is not valid; valid modes: \['default', 'lite'"):
        Config.from_options(None, mode="fast")
    with pytest.raises(OptionsError, match=r"'inductor.mode'='fast' is not valid; valid values: \[None, 'default'"):
        Config.from_options({"inductor.mode": "fast"})


def test_inductor_mode_and_options_reach_inductor_with_moepass_options(monkeypatch):
    import torch._inductor.compile_fx as compile_fx_module
    from torch._inductor import config as inductor_config

    seen = []
    real = compile_fx_module.compile_fx

    def spy(gm, example_inputs, **kwargs):  # compile_fx calls itself again inside its config.patch
        seen.append((kwargs.get("config_patches"), inductor_config.max_autotune,
                     inductor_config.coordinate_descent_tuning))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy)
    model = torch.nn.Linear(32, 32)
    compiled = torch.compile(model, backend="moepass", options={
        "passes": [], "inductor.mode": "max-autotune-no-cudagraphs",
        "inductor.options": {"coordinate_descent_tuning": False}})
    x = torch.randn(4, 32)
    torch.testing.assert_close(compiled(x), model(x))
    patches = seen[0][0]
    assert patches["max_autotune"] is True and patches["coordinate_descent_tuning"] is False
    assert {"post_grad_custom_post_pass", "joint_custom_pre_pass"} <= set(patches)  # moepass's own stay
    assert (True, False) in [s[1:] for s in seen[1:]]  # Inductor compiled under the patched config


@pytest.mark.parametrize("patches, words", [
    ({"max_autotun": True}, ["'max_autotun'", "did you mean ['max_autotune'", "torch._inductor.config"]),
    ({"triton.nope": 1}, ["'triton.nope'", "torch/_inductor/config.py"]),
    ({"post_grad_custom_post_pass": None}, ["moepass sets itself", "leave it out"]),
    (["max_autotune"], ["expected a dict of torch._inductor.config names"]),
])
def test_bad_inductor_options_name_the_key_and_where_to_look(patches, words):
    with pytest.raises(OptionsError) as info:
        Config.from_options({"inductor.options": patches})
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- MOEPASS_OPTIONS


def test_env_options_used_when_none_are_given(monkeypatch):
    monkeypatch.setenv("MOEPASS_OPTIONS", '{"passes": ["linear"], "mxfp8.wgrad_bf16": true}')
    for none_given in (None, {}):
        config = Config.from_options(none_given)
        assert config.pipeline == ("linear",) and config["mxfp8.wgrad_bf16"] is True


def test_env_options_reach_the_backend_through_torch_compile(monkeypatch):
    import moepass

    monkeypatch.setenv("MOEPASS_OPTIONS", '{"passes": ["mxfp8_linear"], "inductor": false}')  # an old name
    compiled = torch.compile(torch.nn.Linear(32, 32), backend="moepass")
    with moepass.collecting() as report:
        compiled(torch.randn(4, 32))
    assert report.config["passes"] == ["linear"] and report.config["inductor"] is False


def test_explicit_options_win_and_env_is_ignored(monkeypatch):
    monkeypatch.setenv("MOEPASS_OPTIONS", '{"passes": ["linear"]}')
    assert Config.from_options({"passes": ["deepep"]}).pipeline == ("deepep",)
    monkeypatch.setenv("MOEPASS_OPTIONS", "{not json")  # ignored whatever it holds
    assert Config.from_options({"passes": ["deepep"]}).pipeline == ("deepep",)


@pytest.mark.parametrize("text, words", [
    ("{not json", ["MOEPASS_OPTIONS", "is not valid JSON", "JSON object of option names"]),
    ('["passes"]', ["MOEPASS_OPTIONS", "is a JSON list, not an object", "Valid options"]),
    ('{"mxfp8.scale_rounding": "nearest"}', ["'rceil', 'floor'", "read from the MOEPASS_OPTIONS environment"]),
])
def test_bad_env_options_name_the_variable(monkeypatch, text, words):
    monkeypatch.setenv("MOEPASS_OPTIONS", text)
    with pytest.raises(OptionsError) as info:
        Config.from_options(None)
    for word in words:
        assert word in str(info.value)


def test_sections_read_the_options_typed_once_per_config():
    config = Config.from_options({"lowp.exclude": ["layers.0.*"], "recipe": "mxfp8", "fp8_rowwise.kernel": "emulated"})
    lowp = config.section("lowp")
    assert isinstance(lowp, Lowp) and lowp.exclude == ("layers.0.*",) and lowp.include == ("*",)
    assert config.section("").recipe == "mxfp8" and config.section("fp8_rowwise").kernel == "emulated"
    assert config.section("lowp") is lowp  # read once: passes read sections per node
    changed = config.with_values(**{"lowp.exclude": ()})
    assert changed.section("lowp").exclude == () and config.section("lowp").exclude == ("layers.0.*",)
    with pytest.raises(KeyError, match="no options under 'lowpp'"):
        config.section("lowpp")
