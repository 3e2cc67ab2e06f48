"""Activation checkpointing the way other people's code turns it on, trained one step through backend="moepass".

- HF transformers 5.23 `gradient_checkpointing_enable()` (its default, non-reentrant) and with
  `use_reentrant=True`, on DeepseekV3, Qwen3Moe and Mixtral: the same rewrites (module paths and reasons) as
  without AC, all inside the checkpoint bodies, and bit-equal loss and gradients (inductor=False).
- torchtitan-style per-block compile (`block.compile(...)`) of blocks under reentrant `torch.utils.checkpoint`,
  with the checkpoint inside the compiled region (Dynamo traces it as the non-reentrant HOP) and around it
  (the reentrant recompute re-enters the compiled block): the same numbers as the uncheckpointed blocks, and
  every MoE layer runs the low-precision grouped GEMMs, although the report names only the first (the
  others replay its graph).
- A selective-checkpoint policy written for BF16 (save `aten.mm` outputs) is asked about the GEMMs moepass rewrote
  as the aten ops they replaced (moepass/inductor_stage/sac_policy.py), so the outputs it saves are not recomputed.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import moepass
from moepass.harness.train import next_token_loss
from moepass.models import build_model

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`:UserWarning"),
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")]

EAGER_REWRITES = {"inductor": False}  # the passes rewrite as with Inductor; the rewritten graph runs eagerly

# tiny configs of tests/integration/test_hf_families.py (its FAMILIES), every GEMM dimension a multiple of 32
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, use_cache=False, attn_implementation="sdpa")
_HF = {
    "DeepseekV3": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                       first_k_dense_replace=1, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
                       qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16),
    "Qwen3Moe": dict(num_experts=32, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
    "Mixtral": dict(num_local_experts=8, num_experts_per_tok=2, head_dim=16),
}
TOKENS = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))


def _hf_model(name: str, checkpointing: dict | None):
    config = getattr(transformers, f"{name}Config")(**{**_TINY, **_HF[name]})
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(config).to(torch.bfloat16).train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing or None)
    return model


def _train_step(model, loss_of, compile_model):
    torch._dynamo.reset()
    with moepass.collecting() as report:
        loss = loss_of(compile_model(model))
        loss.backward()
    grads = {n.replace(".block.", "."): p.grad for n, p in model.named_parameters()}  # ReentrantCheckpoint's segment
    return loss.detach(), grads, report.to_dict()


def _what_was_done(report: dict) -> dict:
    return {p["name"]: (sorted(r["module"] for r in p["rewrites"]),
                        sorted((s["module"], s["reason"]) for s in p["skipped"])) for p in report["passes"]}


def _assert_same_numbers(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    assert torch.equal(loss, want_loss), (loss, want_loss)
    assert grads.keys() == want_grads.keys()
    assert not [n for n in grads if not torch.equal(grads[n], want_grads[n])]


_EXTENDED = pytest.mark.extended  # CI time: pytest -m extended runs these


@pytest.mark.parametrize("checkpointing", [{}, pytest.param({"use_reentrant": True}, marks=_EXTENDED)],
                         ids=["hf_default", "reentrant"])
@pytest.mark.parametrize("name", [n if n == "DeepseekV3" else pytest.param(n, marks=_EXTENDED) for n in _HF])
def test_hf_gradient_checkpointing_keeps_rewrites_and_numbers(name, checkpointing):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    loss_of = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    compile_model = functools.partial(torch.compile, backend="moepass", options=EAGER_REWRITES)
    *plain, plain_report = _train_step(_hf_model(name, None), loss_of, compile_model)
    *checkpointed, report = _train_step(_hf_model(name, checkpointing), loss_of, compile_model)
    assert (report["graphs"], report["ops_before"]["tag_activation_checkpoint"]) == (1, _TINY["num_hidden_layers"])
    assert _what_was_done(report) == _what_was_done(plain_report)
    rewrites = [r["node"] for p in report["passes"] for r in p["rewrites"]]
    assert rewrites and all(node.startswith("wrap_body_") for node in rewrites)  # inside the checkpoint bodies
    _assert_same_numbers(checkpointed, plain)


class ReentrantCheckpoint(nn.Module):
    """A block run under reentrant torch.utils.checkpoint (the default of older training scripts)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=True)


def _debug_model(checkpointed: bool):
    torch.manual_seed(0)
    model = build_model("debug", n_layers=3)  # one dense block, then two MoE blocks
    if checkpointed:
        for i, layer in enumerate(model.layers):
            model.layers[i] = ReentrantCheckpoint(layer)
    return model


def _compile_blocks(where: str):
    """torchtitan's apply_compile: each block compiled in place; `where` the checkpoint is compiled with it."""

    def compile_model(model):
        for layer in model.layers:
            target = layer.block if where == "inner" and isinstance(layer, ReentrantCheckpoint) else layer
            target.compile(backend="moepass", options=EAGER_REWRITES, fullgraph=True)
        return model
    return compile_model


def _grouped_ops_per_forward(model) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.no_grad():  # with grad, autograd adds an event
        model(TOKENS)
    return sum(e.name == "moepass::mxfp8_grouped_mm" for e in prof.events())


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True:UserWarning")  # the no-grad count
@pytest.mark.parametrize("where", ["outer", pytest.param("inner", marks=_EXTENDED)])  # the checkpoint inside the compiled region, or around it
def test_reentrant_checkpoint_per_block_compile(where):
    loss_of = lambda m: next_token_loss(m(TOKENS), TOKENS)  # noqa: E731
    *plain, plain_report = _train_step(_debug_model(False), loss_of, _compile_blocks(where))
    model = _debug_model(True)
    *checkpointed, report = _train_step(model, loss_of, _compile_blocks(where))
    _assert_same_numbers(checkpointed, plain)
    # outer: Dynamo turns the reentrant checkpoint into its (non-reentrant) tag_activation_checkpoint HOP;
    # inner: the no-grad forward and the recompute in the backward each compile a graph per block kind
    assert report["ops_before"].get("tag_activation_checkpoint", 0) == (2 if where == "outer" else 0)
    assert report["graphs"] == (2 if where == "outer" else 4)
    grouped = next(p for p in report["passes"] if p["name"] == "grouped_mm")
    assert grouped["skipped"] == [] and grouped["replaced"] == 3 * (1 if where == "outer" else 2)
    # a block replays the graph of the first block of its kind compiled: the report names that one only (inner:
    # the backward compiles its recompute graph for layers.2, the first block it reaches), yet both run MXFP8
    named = collections.Counter(r["module"].split(".")[1] for r in grouped["rewrites"])
    assert named == ({"1": 3} if where == "outer" else {"1": 3, "2": 3})
    assert _grouped_ops_per_forward(model) == 2 * 3


def _gemms_a_policy_sees(compile_model, policy_saves_mm: bool = True):
    """What a selective-AC policy is asked about during one training step, and how often the step runs each
    moepass GEMM op (forward plus any recompute in the backward)."""
    seen = collections.Counter()

    def save_mm(ctx, func, *args, **kwargs):
        seen[func] += 1
        if policy_saves_mm and func is torch.ops.aten.mm.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    torch.manual_seed(0)
    model = build_model("debug", n_layers=2)  # one dense block, one MoE block
    context_fn = functools.partial(create_selective_checkpoint_contexts, save_mm)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer, context_fn=context_fn)
    torch._dynamo.reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        next_token_loss(compile_model(model)(TOKENS), TOKENS).backward()
    ran = collections.Counter(e.name for e in prof.events() if e.name == "aten::mm")  # emulated GEMMs run as mm
    asked = collections.Counter({str(f): n for f, n in seen.items() if str(f).startswith(("aten.mm", "aten._grouped"))})
    return asked, ran


def test_selective_checkpoint_policy_sees_the_gemms_it_was_written_for(monkeypatch):
    """The policy is asked about the aten.mm each rewritten linear replaced, so what it saves is not recomputed."""
    bf16, _ = _gemms_a_policy_sees(lambda m: m)
    moepass_compile = functools.partial(torch.compile, backend="moepass", options=EAGER_REWRITES)
    rewritten, ran = _gemms_a_policy_sees(moepass_compile)
    assert bf16["aten.mm.default"] == 15  # 7 linears in the dense block, 8 in the MoE block
    assert rewritten == bf16
    _, ran_saving_nothing = _gemms_a_policy_sees(moepass_compile, policy_saves_mm=False)  # as full AC
    monkeypatch.setattr("moepass.inductor_stage.sac_policy.show_policies_replaced_gemms", lambda gm: 0)
    _, ran_untranslated = _gemms_a_policy_sees(moepass_compile)  # the policy saves only the BF16 router
    # emulated GEMMs run as aten::mm: fewest when the policy saves the rewritten linears, more when it saves only
    # the routers, most when it saves nothing
    assert ran["aten::mm"] < ran_untranslated["aten::mm"] < ran_saving_nothing["aten::mm"]
