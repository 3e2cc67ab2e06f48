"""torchtune's MoE (`torchtune/modules/moe/`, GitHub main: the registry's 0.6.1 has none), unmodified, in a small
decoder built for CPU training.

The files are copied as they are under tests/assets/torchtune_moe/ (SOURCE says from where, LICENSE is torchtune's):
the moe package, `modules/feed_forward.py` (the shared expert's FeedForward), and the small modules they import
(`utils/_device.py`, `utils/_import_guard.py`, `utils/_logging.py`, `modules/peft/_utils.py`). The package
`__init__`s above them would import the rest of torchtune: `load()` makes bare packages in their place, and
`torchtune.modules.peft` holds only AdapterModule, from its `_utils.py`.

On CPU, `GroupedExperts` loops over the experts with `torch.matmul(x_e, W_e)`, W_e a [K, N] slice of a [E, K, N]
parameter. It takes `torch._grouped_mm` instead when the machine has an sm_90+ GPU, whatever the tensors' device:
`load()` turns the moe package's own switch (`utils.use_grouped_mm`) off, so the CPU tensors here take the loop on
every machine. The router counts tokens per expert with `torch.histc` of int64 expert ids, which CUDA takes and CPU
(and its meta kernel) refuse: `integer_histc_on_cpu()` lets CPU count them as CUDA does, while it is entered.

The MoE layer is built as torchtune's `llama4_moe` builds it (router gate nn.Linear(dim, E), GroupedExperts, a
FeedForward shared expert); the decoder around it is written here: embedding, blocks of RMSNorm + causal SDPA
attention (nn.Linear q, k, v, o) and RMSNorm + MoE with residual adds, final norm, vocabulary head.

API: TINY, load(), integer_histc_on_cpu(), build(seed) -> TinyMoEDecoder, example_ids(), loss_fn(model, ids).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "torchtune_moe")
PACKAGE = os.path.join(ASSETS, "torchtune")


@dataclasses.dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 2
    num_experts: int = 8
    experts_per_token: int = 2
    hidden_dim: int = 32  # each expert's and the shared expert's


TINY = TinyConfig()
BATCH, SEQ = 2, 32


def _bare_package(name: str, path: str) -> types.ModuleType:
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
    return package


def load() -> types.ModuleType:
    """`torchtune.modules.moe` from the assets (once per process)."""
    moe = sys.modules.get("torchtune.modules.moe")
    if moe is not None:
        assert moe.__file__.startswith(ASSETS), f"another torchtune is imported: {moe.__file__}"
        return moe
    assert "torchtune" not in sys.modules, "another torchtune is imported: the assets' copy would mix with it"
    torchtune = _bare_package("torchtune", PACKAGE)
    torchtune.modules = _bare_package("torchtune.modules", os.path.join(PACKAGE, "modules"))
    torchtune.utils = _bare_package("torchtune.utils", os.path.join(PACKAGE, "utils"))
    peft = _bare_package("torchtune.modules.peft", os.path.join(PACKAGE, "modules", "peft"))
    peft.AdapterModule = importlib.import_module("torchtune.modules.peft._utils").AdapterModule
    torchtune.modules.peft = peft
    moe = importlib.import_module("torchtune.modules.moe")
    # its own switch: the grouped path (taken on an sm_90+ GPU) needs CUDA tensors, and these are CPU tensors
    moe.utils.use_grouped_mm = False
    return moe


@contextlib.contextmanager
def integer_histc_on_cpu():
    """`torch.histc` of integer tensors on CPU counts as on CUDA (through float64, exact for ids), real and fake."""
    lib = torch.library.Library("aten", "IMPL")

    def histc(input, bins=100, min=0, max=0):
        with torch._C._AutoDispatchBelowAutograd():
            if input.is_floating_point():
                return torch.ops.aten.histc.default(input, bins, min, max)
            return torch.ops.aten.histc.default(input.double(), bins, min, max).to(input.dtype)

    # the Python dispatcher (fake tensors) caches each op's kernel per key: a histc traced before would bypass this one
    histc_op = torch.ops.aten.histc.default
    lib.impl("histc", histc, "AutogradCPU")  # above CPU and Meta: both refuse integer inputs
    histc_op._dispatch_cache.clear()
    try:
        yield
    finally:
        lib._destroy()
        histc_op._dispatch_cache.clear()


def llama4_moe(moe, feed_forward, dim: int, hidden_dim: int, num_experts: int, experts_per_token: int):
    """torchtune.models.llama4._component_builders.llama4_moe (use_shared_expert=True), without its NF4 option."""
    router = moe.TokenChoiceTopKRouter(gate=nn.Linear(dim, num_experts, bias=False), dim=dim, num_experts=num_experts,
                                       experts_per_token=experts_per_token)
    experts = moe.GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
    shared_expert = feed_forward.FeedForward(gate_proj=nn.Linear(dim, hidden_dim, bias=False),
                                             down_proj=nn.Linear(hidden_dim, dim, bias=False),
                                             up_proj=nn.Linear(dim, hidden_dim, bias=False))
    return moe.MoE(experts=experts, router=router, shared_expert=shared_expert)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output_proj(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig, moe, feed_forward):
        super().__init__()
        self.sa_norm, self.mlp_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.n_heads)
        self.mlp = llama4_moe(moe, feed_forward, cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.experts_per_token)

    def forward(self, x):
        x = x + self.attn(self.sa_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyMoEDecoder(nn.Module):
    def __init__(self, cfg: TinyConfig = TINY):
        super().__init__()
        moe = load()
        feed_forward = importlib.import_module("torchtune.modules.feed_forward")
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, moe, feed_forward) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, ids):
        h = self.tok_embeddings(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def build(seed: int = 0) -> TinyMoEDecoder:
    torch.manual_seed(seed)
    model = TinyMoEDecoder()
    for module in model.modules():
        if hasattr(module, "reset_parameters") and "GroupedExperts" in type(module).__name__:
            module.reset_parameters()  # torchtune leaves its expert stacks torch.empty until a checkpoint loads
    return model.to(torch.bfloat16)


def example_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def loss_fn(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
