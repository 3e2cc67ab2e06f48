"""HF transformers' DeepseekV3, unmodified, under DistributedDataParallel on 2 gloo ranks, compiled with moepass.

DDP's graph splitting (`torch._dynamo.config.optimize_ddp`: Dynamo's DDPOptimizer) cuts the forward at gradient-bucket
boundaries and hands the backend each piece as its own graph. Buckets of 1 MiB (the least DDPOptimizer takes: its
first bucket is 1 MiB) cut this 4.7 MiB model into 4 subgraphs; two cuts fall right after interior linears
(`layers.0.mlp.gate_proj` and `up_proj`, `layers.2.self_attn.q_b_proj`), which then end their graphs as the output
head would. Every linear must be rewritten as without DDP; only the router gates and `lm_head` stay BF16.

Each rank trains STEPS AdamW steps on its own batch, compiled with moepass and uncompiled (both under DDP, from the
same weights). Its losses agree within LOSS_RTOL at every step (tests/integration/test_unseen_models.py's bar; MXFP8 emulated
moved them by under 0.5% here); the parameters stay equal across ranks (DDP's all-reduce still runs); the first
step's graphs hold exactly the GEMMs below, none unaccounted. CI runs the rewritten graphs eagerly (inductor=False);
`-m extended` compares moepass's Inductor path with backend="inductor".
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import rank_pool  # noqa: F401  (a fixture)

pytest.importorskip("transformers")

STEPS = 3
LR = 3e-4
LOSS_RTOL = 0.05
BUCKET_CAP_MB = 1
# 1 dense + 3 MoE layers, 8 experts, top-2, a shared expert; every GEMM's K and N a multiple of 32 but the routers'
CONFIG = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16, use_cache=False, attn_implementation="sdpa")
# per layer attention q_a, q_b, kv_a, kv_b, o (20); dense MLP 3; per MoE layer router 1, experts' 2 grouped GEMMs,
# shared expert 3 (18); lm_head 1
GEMMS, BF16 = 42, {"ROUTER_GATE": 3, "OUTPUT_HEAD": 1}
HEAD, ROUTER = "module.lm_head", "mlp.gate"  # DDP's `module.` prefix: the state_dict names under DDP
SUBGRAPHS_AT_LEAST = 3


def build():
    import transformers

    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG)).to(torch.bfloat16)


def train(backend: str, rank: int, options: dict | None = None):
    """Losses of STEPS steps of the DDP-wrapped model (uncompiled for "eager"), each step's moepass report, and the
    parameters after the last step."""
    import moepass
    from torch.nn.parallel import DistributedDataParallel

    torch._dynamo.reset()
    model = build()
    ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    run = ddp if backend == "eager" else torch.compile(ddp, backend=backend, options=options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(10 + rank))
    losses, reports = [], []
    for _ in range(STEPS):
        with moepass.collecting() as report:
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        reports.append(report)
    return losses, reports, torch.cat([p.detach().float().flatten() for p in model.parameters()])


def check_ddp_training(rank, world_size, options, reference):
    import warnings

    from moepass.report import coverage

    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    losses, reports, params = train("moepass", rank, options)
    want, _, _ = train(reference, rank)
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0], losses
    for step, (g, w) in enumerate(zip(losses, want)):
        assert g == pytest.approx(w, rel=LOSS_RTOL), f"rank {rank} step {step}: {losses} vs {want}"

    lo, hi = params.clone(), params.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi), f"rank {rank}: parameters differ across ranks"

    first = reports[0]
    assert len(first.graphs) >= SUBGRAPHS_AT_LEAST, f"DDP handed moepass {len(first.graphs)} graph(s)"
    cov = first.coverage()
    assert cov["unaccounted"] == 0, cov["unaccounted_gemms"]
    assert (cov["gemms"], cov["bf16"], cov["low_precision"]) == (GEMMS, BF16, GEMMS - sum(BF16.values())), cov
    for report in reports:
        for use in (u for g in report.graphs for u in g.gemms if u.status != coverage.NOT_WEIGHT):
            where = f"rank {rank}: {use}"
            assert use.status != coverage.UNACCOUNTED, where
            assert (use.code == "ROUTER_GATE") == use.module.endswith(ROUTER), where
            assert (use.code == "OUTPUT_HEAD") == (use.module == HEAD), where
            assert use.status == coverage.LOW_PRECISION or use.code in BF16, where


def test_ddp_subgraphs_rewritten_like_the_whole_model(rank_pool):
    rank_pool(2).run(check_ddp_training, {"inductor": False}, "eager", timeout_s=600)


@pytest.mark.extended
def test_ddp_matches_inductor(rank_pool):
    """moepass's passes and Inductor against backend="inductor", both under DDP (~3-5 min on 2 cores)."""
    rank_pool(2).run(check_ddp_training, None, "inductor", timeout_s=1500)
