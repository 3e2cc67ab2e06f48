"""recipe="auto" on a GEMM no shipped table holds: measured on the GPU once, cached on disk (moepass/recipes/measure.py),
or the size rule; the reason names which source decided."""

import json

import pytest
import torch

from moepass.ops.lowp.fp8_rowwise.kernels import choice as fp8_choice
from moepass.options import Config
from moepass.recipes import auto, measure
from moepass.recipes.plan import plan_gemm
from moepass.skips import Reason

GPU = "NVIDIA Test Hopper"  # sm_90 with no shipped table


@pytest.fixture
def hopper(monkeypatch, tmp_path):
    """A pretend sm_90 GPU with no shipped table, a fresh cache directory, and timings a test sets."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fp8_choice, "_triton_available", lambda: True)
    monkeypatch.setenv(measure.CACHE_ENV, str(tmp_path))
    measure._cache.cache_clear()
    timed = []

    def timings(bf16_ms, fp8_ms):
        def measured(*args):
            timed.append(args)
            return bf16_ms, fp8_ms
        monkeypatch.setattr(measure, "measure_linear", measured)
        monkeypatch.setattr(measure, "measure_grouped", measured)
        return timed

    yield timings
    measure._cache.cache_clear()


def test_a_shape_no_table_holds_is_measured_once_and_read_back_from_the_cache(hopper):
    timed = hopper(2.0, 1.0)
    recipe, reason = auto.choose_recipe("cuda", "linear", 8192, 4096, 4096, measure=True)
    assert recipe == "fp8_rowwise" and "2.00x" in reason and f"measured on this {GPU} now" in reason
    assert timed == [(torch.device("cuda"), 8192, 4096, 4096)]
    path = measure.cache_path(GPU)
    data = json.loads(path.read_text())
    assert data["key"]["gpu"] == GPU and data["key"]["torch"] == torch.__version__
    assert data["entries"]["linear K=4096 N=4096 M=8192"]["speedup"] == 2.0
    measure._cache.cache_clear()  # a new process: the verdict comes from the file
    recipe, reason = auto.choose_recipe("cuda", "linear", 8192, 4096, 4096, measure=True)
    assert recipe == "fp8_rowwise" and len(timed) == 1 and f"cached in {path}" in reason and " now " not in reason


def test_a_measured_loss_keeps_bf16_even_where_the_size_rule_would_take_fp8(hopper):
    hopper(1.0, 1.5)
    rule, _ = auto.choose_recipe("cuda", "linear", 16384, 8192, 8192)
    assert rule == "fp8_rowwise"
    recipe, reason = auto.choose_recipe("cuda", "linear", 16384, 8192, 8192, measure=True)
    assert recipe == "bf16" and reason.startswith("left in BF16: FP8 rowwise does not pay here") and "0.67x" in reason


def test_grouped_gemms_are_measured_per_expert_load(hopper):
    timed = hopper(3.0, 2.0)
    recipe, reason = auto.choose_recipe("cuda", "grouped", 16 * 1000, 4096, 2048, experts=16, measure=True)
    assert recipe == "fp8_rowwise" and "tokens_per_expert=1000" in reason
    assert timed == [(torch.device("cuda"), 16, 1000, 4096, 2048)]


def test_rows_received_by_expert_parallelism_are_not_measured_on_static_rows(hopper):
    from moepass.analysis.routed_rows import ExpectedRows
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    timed = hopper(3.0, 1.0)
    received = ShapeEnv().create_unbacked_symint()
    recipe, reason = auto.choose_recipe("cuda", "grouped", received, 4096, 2048, experts=16, measure=True,
                                        expected=lambda: ExpectedRows(16 * 4096, "sent"))
    assert timed == [] and recipe == "bf16" and "not measured" in reason


def test_measuring_off_or_failing_leaves_the_size_rule_saying_so(hopper, monkeypatch):
    timed = hopper(3.0, 1.0)
    recipe, reason = auto.choose_recipe("cuda", "linear", 8192, 4096, 4096, measure=False)
    assert timed == [] and "decided by the size rule" in reason

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(measure, "measure_linear", out_of_memory)
    recipe, reason = auto.choose_recipe("cuda", "linear", 8192, 4096, 4096, measure=True)
    assert "decided by the size rule" in reason and "measuring it on this GPU failed (OutOfMemoryError" in reason
    assert not measure.cache_path(GPU).exists()  # a failure is not a verdict


def test_the_option_auto_measure_reaches_the_decision(hopper):
    timed = hopper(2.0, 1.0)
    off = plan_gemm(Config.from_options({"auto.measure": False}), "linear", torch.device("cuda"), 8192, 4096, 4096)
    assert timed == [] and isinstance(off, Reason) and "size rule" in str(off)  # M=8192 < 16384: BF16 by the rule
    on = plan_gemm(Config.from_options({}), "linear", torch.device("cuda"), 8192, 4096, 4096)
    assert len(timed) == 1 and on.recipe == "fp8_rowwise" and "measured on this" in on.why


def test_the_cache_key_names_what_changes_a_timing(monkeypatch, tmp_path):
    monkeypatch.setenv(measure.CACHE_ENV, str(tmp_path))
    key = measure.cache_key(GPU)
    assert set(key) == {"gpu", "driver", "cuda", "torch", "torchao", "moepass", "kernels"}
    assert measure.cache_path(GPU) != measure.cache_path("NVIDIA H20")
    measure.cache_key.cache_clear()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    try:
        assert measure.cache_path(GPU).name != (tmp_path / "x").name and measure.cache_key(GPU)["torch"] == "9.9.9"
        other = measure.cache_path(GPU)
    finally:
        measure.cache_key.cache_clear()
    monkeypatch.undo()
    monkeypatch.setenv(measure.CACHE_ENV, str(tmp_path))
    assert measure.cache_path(GPU) != other  # another torch: another file


@pytest.mark.gpu
def test_measuring_runs_on_a_real_gpu(tmp_path, monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("FP8 rowwise grouped GEMMs need sm_90")
    monkeypatch.setenv(measure.CACHE_ENV, str(tmp_path))
    measure._cache.cache_clear()
    device = torch.device("cuda")
    bf16_ms, fp8_ms = measure.measure_linear(device, 4096, 2048, 2048)
    assert 0 < bf16_ms < 100 and 0 < fp8_ms < 100
    bf16_ms, fp8_ms = measure.measure_grouped(device, 8, 512, 2048, 1024)
    assert 0 < bf16_ms < 100 and 0 < fp8_ms < 100
    verdict, source = measure.verdict("this GPU", device, "linear", 2048, 2048, 4096, None)
    assert verdict is not None and "cached in" in source
