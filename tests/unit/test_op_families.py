"""The low-precision op families (moepass/ops/lowp/linear.py, grouped_mm.py), one per GEMM kind, instantiated per
recipe (moepass.recipes.registry): shared checks in the same words for every recipe, one device probe, leaf GEMM
primitives, every GEMM op known to moepass.op_registry. Each recipe's numerics are in test_mxfp8_ops.py,
test_fp8_rowwise_ops.py and test_blockwise_ops.py."""

import ast
import pathlib

import pytest
import torch

import moepass.ops  # noqa: F401  (registers torch.ops.moepass.*)
from moepass import device_arch
from moepass.op_registry import GemmRole, gemm_role, is_dispatch, is_exchange
from moepass.ops.lowp.fp8_rowwise import decomp as fp8_rowwise_decomp
from moepass.ops.lowp.fp8_rowwise.kernels import scaled_gemms
from moepass.options import Config
from moepass.recipes import registry

BF16 = torch.bfloat16
# every built-in recipe, with its op settings under the default options
RECIPES = {name: (registry.RECIPES[name], registry.RECIPES[name].settings(Config.from_options({})))
           for name in ("mxfp8", "fp8_rowwise", "blockwise")}


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_gets_six_ops_whose_schemas_end_in_its_settings_and_kernel(name):
    recipe, _ = RECIPES[name]
    own = [s.split()[-1] for s in recipe.op_settings]
    for gemm in ("linear", "linear_dgrad", "linear_wgrad", "grouped_mm", "grouped_mm_dgrad", "grouped_mm_wgrad"):
        args = [a.name for a in recipe.op(gemm).default._schema.arguments]
        forward = gemm in ("linear", "grouped_mm")
        tail = [*own, *(["wgrad_bf16"] if forward else []), "kernel"]
        assert args[-len(tail):] == tail and set(args[:-len(tail)]) <= {"x", "weight", "bias", "grad_out", "w_t", "offs"}
        assert str(recipe.op(gemm).default._schema.name) == f"moepass::{name}_{gemm}"


@pytest.mark.parametrize("name", RECIPES)
def test_checks_name_the_op_and_the_operand_in_the_same_words_for_every_recipe(name):
    recipe, settings = RECIPES[name]
    w, w_t, offs = torch.randn(64, 64, dtype=BF16), torch.randn(2, 64, 64, dtype=BF16), torch.tensor([3, 8]).int()
    with pytest.raises(ValueError, match=rf"^{name}_linear_dgrad: grad_out is torch.float32"):
        recipe.op("linear_dgrad")(torch.randn(4, 64), w, *settings, "emulated")
    with pytest.raises(ValueError, match=rf"^{name}_linear_wgrad: grad_out \(4, 64\) and x \(5, 64\) must share"):
        recipe.op("linear_wgrad")(torch.randn(4, 64, dtype=BF16), torch.randn(5, 64, dtype=BF16), *settings, "emulated")
    with pytest.raises(ValueError, match=rf"^{name}_grouped_mm_dgrad: grad_out \(8, 32\) does not match w_t .* along N"):
        recipe.op("grouped_mm_dgrad")(torch.randn(8, 32, dtype=BF16), w_t, offs, *settings, "emulated")
    with pytest.raises(ValueError, match=rf"^{name}_grouped_mm: offs must be int32 \[E\].*E=2"):
        recipe.op("grouped_mm")(torch.randn(8, 64, dtype=BF16), w_t, offs[:1], *settings, False, "emulated")


def test_probe_names_the_cuda_device_or_says_why_there_is_none(monkeypatch):
    probe = device_arch.probe
    assert probe(torch.device("cpu"), "FP8", "emulated") == "CPU: no FP8 tensor cores; emulated"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe(torch.device("cuda"), "MXFP8", "emulated") == "cuda: CUDA is not available in this process; emulated"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0) if index == 1 else (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: f"GPU {index}")
    cuda = probe(torch.device("cuda"), "FP8", "emulated")
    assert str(cuda) == "cuda:1 is sm_90 (GPU 1)" and cuda.capability == (9, 0)
    assert str(probe(torch.device("cuda", 0), "FP8", "emulated")) == "cuda:0 is sm_100 (GPU 0)"


def _moepass_imports(module) -> set[str]:
    """The moepass.ops modules `module` imports (relative imports), by name."""
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found |= {n for n in names if n and n.startswith("moepass")}
    return found


def test_gemm_primitives_are_a_leaf_and_the_decomposition_imports_no_op_module():
    assert _moepass_imports(scaled_gemms) == set()
    # the decomposition may use the quantization, the GEMM primitives and the shared Inductor fallback registration;
    # never a module that registers ops (importing one would register the ops it decomposes)
    assert _moepass_imports(fp8_rowwise_decomp) == {"quant", "kernels.scaled_gemms", "inductor_fallbacks"}


@pytest.mark.parametrize("name", RECIPES)
def test_every_gemm_op_is_registered_with_its_kind_and_role(name):
    recipe, _ = RECIPES[name]
    for kind, family in (("linear", "linear"), ("grouped", "grouped_mm")):
        for suffix, role in (("", "forward"), ("_dgrad", "dgrad"), ("_wgrad", "wgrad")):
            op = recipe.op(family + suffix)
            assert gemm_role(op) == gemm_role(op.default) == GemmRole(kind, role)


def test_only_gemm_ops_have_a_gemm_role_and_only_ep_exchanges_are_exchanges():
    ops = torch.ops.moepass
    assert gemm_role(ops.grouped_mm_wgrad_bf16.default) == GemmRole("grouped", "wgrad")
    for op in (ops.fp8_rowwise_rows_and_cols, ops.fp8_rowwise_expert_weights, ops.fp8_rowwise_token_group_cols,
               ops.ep_dispatch, ops.ep_combine, ops.ep_expert_major_pairs, torch.ops.aten.mm):
        assert gemm_role(op.default) is None, op
    for op in (ops.ep_dispatch, ops.ep_combine, ops.ep_dispatch_cached, ops.ep_dispatch_backward):
        assert is_exchange(op.default), op
        assert is_dispatch(op.default) is (op is ops.ep_dispatch), op  # the one whose arguments hold the [T, K] ids
    assert not is_exchange(ops.ep_expert_major_pairs.default) and not is_exchange(ops.mxfp8_linear.default)
    assert not is_dispatch(ops.ep_dispatch_quantized.default) and not is_dispatch(torch.ops.aten.mm.default)
