"""DeepSeek-V3's own reference model (`inference/model.py` + `kernel.py`), unmodified, built tiny for CPU training.

The two files are copied as they are in tests/assets/deepseek_v3_reference/ (SOURCE says from where, LICENSE-CODE
is their licence). Everything a CPU and training need is done here, at run time, on a private copy of the module:
- `kernel` (its Triton FP8 kernels) is imported for model.py, but BF16 weights never reach it (`linear` takes
  `F.linear` when `weight.element_size() > 1`; MLA dequantizes `wkv_b` only when it has a scale);
- the module global `attn_impl` ("naive": wkv_b as a linear; "absorb": wkv_b's weight read per head by einsums) is
  set per model; `world_size`/`rank` are model.py's own (1/0: built outside a process group);
- `Transformer.forward` runs without its `@torch.inference_mode()` (its `__wrapped__`), so autograd sees it;
- parameters are created with `torch.empty` (a checkpoint fills them): they are drawn here, seeded;
- MLA writes each step's keys into inference KV caches (buffers): `forget_caches` detaches them between steps.

API: TINY (ModelArgs overrides), load(attn_impl), build(attn_impl, seed) -> Transformer, example_tokens(),
loss_fn(model, tokens, targets), forget_caches(model) before each training step.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.nn.functional as F

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "deepseek_v3_reference")

# 1 dense and 1 MoE layer, 8 experts, top-2, MLA with a query LoRA; every GEMM's K and N a multiple of 32 except the
# router gate's N (8 experts)
TINY = dict(max_batch_size=2, max_seq_len=32, vocab_size=256, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2,
            n_dense_layers=1, n_heads=2, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
BATCH, SEQ = 2, 32


def load(attn_impl: str):
    """A fresh module object of model.py (its own globals), with kernel.py as its `kernel`."""
    kernel_spec = importlib.util.spec_from_file_location("kernel", os.path.join(ASSETS, "kernel.py"))
    kernel = importlib.util.module_from_spec(kernel_spec)
    kernel_spec.loader.exec_module(kernel)
    name = f"deepseek_v3_reference_{attn_impl}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(ASSETS, "model.py"))
    model = importlib.util.module_from_spec(spec)
    previous = sys.modules.get("kernel")
    sys.modules["kernel"] = kernel  # model.py does `from kernel import ...`
    try:
        spec.loader.exec_module(model)
    finally:
        if previous is None:
            del sys.modules["kernel"]
        else:
            sys.modules["kernel"] = previous
    sys.modules[name] = model  # Dynamo and pickling look modules up by name
    model.attn_impl = attn_impl
    model.Transformer.forward = model.Transformer.forward.__wrapped__  # without @torch.inference_mode()
    return model


def build(attn_impl: str = "naive", seed: int = 0, **overrides) -> torch.nn.Module:
    reference = load(attn_impl)
    args = reference.ModelArgs(**{**TINY, **overrides})
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as model.py's own __main__: norms, gate, embedding and head in BF16
    try:
        model = reference.Transformer(args)
    finally:
        torch.set_default_dtype(default_dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):  # RMSNorm weights are ones already
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def example_tokens(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S], next-token targets [B]): the reference returns the last position's logits only."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, -1]


def loss_fn(model, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens).float(), targets)


def forget_caches(model) -> None:
    """Cut the KV caches from the last step's autograd graph: MLA writes each step's keys into them in place, so
    the next backward would run through the freed graph of the step before (a training loop calls this per step)."""
    for name, buffer in model.named_buffers():
        if name.endswith("_cache"):
            buffer.detach_()

