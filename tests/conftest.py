import os
import sys
import tempfile

# Inductor's CPU code without SIMD: its vectorized C++ codegen (tiling analysis in sympy) was a third of a compile
# here, and these tests use Inductor's CPU backend only as a stand-in for the GPU's (the debug model's first compiled
# step: 55 s -> 38 s on 2 cores, same loss). Set before torch is imported: Inductor reads it then, and every rank
# process and CLI subprocess a test starts inherits it. Export TORCHINDUCTOR_VEC_ISA_OK=1 to test vectorized code.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Every GEMM a test compiles with moepass is rewritten or has its reason: an unaccounted one fails the compile that
# found it (moepass.report.coverage), here and in every rank process and CLI subprocess (they inherit the environment).
os.environ.setdefault("MOEPASS_STRICT_GEMMS", "1")
# recipe="auto" caches what it measures on a GPU (moepass.recipes.measure): tests keep theirs apart from the user's
os.environ.setdefault("MOEPASS_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"moepass-test-cache-{os.getpid()}"))

import pytest  # noqa: E402
import torch  # noqa: E402

# tests/ holds the tests by tier (unit, integration, gpu, sweep) and what they share (fixtures/): `from helpers import`,
# `import realstack`, `from doubles import` from any tier, in any import mode; fixtures/independent: models written
# apart from models/, imported by module name
FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
sys.path.insert(0, FIXTURES)
sys.path.insert(0, os.path.join(FIXTURES, "independent"))


def capture_dynamo_graphs(fn, *args, **kwargs) -> list[torch.fx.GraphModule]:
    """The Dynamo FX graphs of `fn(*args)`, as a pass would see them (nothing is rewritten)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(fn, backend=backend)(*args, **kwargs)
    return graphs


@pytest.fixture
def dynamo_graphs():
    return capture_dynamo_graphs


def _hidden_config_entries() -> set[str]:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    return {f"{module.__name__}.{name}" for module in (dynamo_config, inductor_config)
            for name, entry in module._config.items() if entry.hide}


_HIDDEN_AT_START = _hidden_config_entries()


@pytest.fixture(autouse=True)
def _torch_config_entries_stay_visible():
    """pytest 9's monkeypatch undoes a torch config entry it set with delattr, which hides the entry from every later
    compile in the worker ("... does not exist"): fail the test that did it, not the tests after it."""
    yield
    hidden = _hidden_config_entries() - _HIDDEN_AT_START
    assert not hidden, (f"this test hid torch config entries {sorted(hidden)}: set them with "
                        "torch._inductor.config.patch / torch._dynamo.config.patch, not monkeypatch.setattr")


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    n_gpu = torch.cuda.device_count() if has_cuda else 0
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ CUDA GPUs"))
    # The longest files first (CPU seconds, 2 cores): under pytest-xdist's --dist loadfile a worker takes a
    # whole file, so a long file started last runs alone at the end and sets the wall time. Stable: the
    # order inside a file, and of every other file, stays as collected.
    items.sort(key=lambda item: _LONGEST_FIRST.get(os.path.basename(str(item.fspath)), len(_LONGEST_FIRST)))


_LONGEST_FIRST = {name: i for i, name in enumerate((
    "test_tensor_parallel.py", "test_torchtitan.py", "test_torchtitan_trainer.py", "test_inductor_route.py", "test_docs_examples.py", "test_bounded_counts.py",
    "test_ep_catalog_bounded.py", "test_hf_trainer.py", "test_lightning.py", "test_unseen_models.py", "test_report_index.py", "test_ddp.py", "test_independent_models.py", "test_ep_scale.py", "test_pipeline_parallel.py", "test_model_ep.py", "test_deepep_pass.py", "test_deepep_pass_on_double.py", "test_bench.py",
    "test_sweep.py", "test_ep_catalog.py", "test_model_numerics.py", "test_activation_checkpoint.py", "test_cli.py",
    "test_backend_e2e.py", "test_hf_families.py", "test_converge.py", "test_bench_ep_dispatch.py", "test_install.py",
    "test_ac_user_styles.py", "test_ep_ops.py", "test_deepep_double.py", "test_toy_recipe.py", "test_model.py"))}
