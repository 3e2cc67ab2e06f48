"""The deepep pass on 2 GPUs over NCCL: the debug DeepSeek-V3 with EP, real DeepEP against the reference.

Needs 2+ CUDA GPUs; the DeepEP case also needs `deep_ep` importable. The rewritten graph runs without
Inductor (`inductor=False`) so the comparison isolates the rewrite: the reference backend must match the
uncompiled model bit for bit, DeepEP (which combines in bf16) within bf16 tolerances.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from helpers import nccl_ranks  # noqa: F401  (a fixture)

pytestmark = pytest.mark.multigpu


def _run(model, tokens, options=None):
    import moepass

    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    with moepass.collecting() as report:
        fn = torch.compile(model, backend="moepass", options=options) if options is not None else model
        out = fn(tokens)
        g = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
        (out.float() * g).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, report.to_dict()


def check_debug_model_on_gpus(rank, world_size, backend):
    import moepass.backend  # noqa: F401  (what torch.compile(backend="moepass") imports)
    from moepass.models import build_model

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = build_model("debug", n_layers=3, ep_group=dist.group.WORLD).cuda()
    tokens = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(rank)).cuda()
    ref_out, ref_grads, _ = _run(model, tokens)
    out, grads, report = _run(model, tokens, {"passes": ["deepep"], "inductor": False, "deepep.backend": backend})
    deepep = next(p for p in report["passes"] if p["name"] == "deepep")
    assert report["graphs"] == 1, report["graphs"]
    assert deepep["replaced"] == 2 and deepep["skipped"] == [], (deepep, torch.__version__)
    assert set(deepep["implementations"]) == {backend}, deepep["implementations"]
    assert not [k for k in report["ops_after"] if k.endswith(("all_to_all_single", "wait_tensor"))]
    if backend == "reference":
        assert torch.equal(out, ref_out)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
        return
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=6e-2)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().float()
        assert (grad.float() - ref_grads[name].float()).abs().max() <= scale / 32, name


def test_reference_backend_on_nccl_matches_uncompiled_bitwise(nccl_ranks):
    nccl_ranks(2).run(check_debug_model_on_gpus, "reference", timeout_s=300)


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")
def test_real_deepep_matches_uncompiled_model(nccl_ranks):
    nccl_ranks(2).run(check_debug_model_on_gpus, "deepep", timeout_s=300)


def check_fp8_rows_through_real_deepep(rank, world_size):
    """quantize_once sends fp8_rowwise's FP8 rows through DeepEP's FP8 dispatch: the forward equals quantizing after
    the dispatch, bit for bit (the same e4m3 rows and scales reach the same kernels)."""
    import moepass.backend  # noqa: F401
    from moepass.models import build_model

    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    model = build_model("debug", n_layers=2, ep_group=dist.group.WORLD).cuda()
    tokens = torch.randint(0, 2048, (4, 64), generator=torch.Generator().manual_seed(rank)).cuda()
    base = {"recipe": "fp8_rowwise", "deepep.backend": "deepep", "inductor": False}
    ref_out, _, _ = _run(model, tokens, {**base, "passes": ["deepep", "grouped_mm"]})
    out, grads, report = _run(model, tokens, {**base, "passes": ["deepep", "grouped_mm", "quantize_once"]})
    assert report["ops_after"].get("moepass.ep_dispatch_quantized") == 1, report["ops_after"]
    assert torch.equal(out, ref_out)
    assert all(g.isfinite().all() for g in grads.values())


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="deep_ep is not installed")
def test_fp8_rows_through_real_deepep(nccl_ranks):
    nccl_ranks(2).run(check_fp8_rows_through_real_deepep, timeout_s=300)
