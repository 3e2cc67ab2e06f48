"""The output head is known by what it is (vocabulary-sized, tied to the embedding, feeding the loss, returned by the
model), not by where a graph ends: a linear that ends a graph cut by a graph break, a frame Dynamo compiled apart or
a DDP bucket stays eligible, and the head is reported under its module path, never ''. An expert's GEMM is never the
head, and a MoE layer compiled on its own has none."""

from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.analysis import module_paths
from moepass.passes.linear import find_linears
from moepass.skips import SkipCode

VOCAB, DIM, HIDDEN = 256, 64, 128
OPTIONS = {"inductor": False}


class Block(nn.Module):
    def __init__(self, break_after_up: bool = False):
        super().__init__()
        self.break_after_up = break_after_up
        self.up, self.down = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, h):
        u = F.silu(self.up(h))
        if self.break_after_up:
            torch._dynamo.graph_break()  # `up` is the last GEMM of the graph before the break
        return h + self.down(u)


class OwnFrameHead(nn.Module):
    """A head whose forward Dynamo compiles as a frame of its own (DeepSeek's ColumnParallelLinear after a break):
    no enclosing module is recorded for its GEMM."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) / 8)

    def forward(self, x):
        torch._dynamo.graph_break()
        return F.linear(x, self.weight)


class TinyLM(nn.Module):
    def __init__(self, head: str = "linear", break_after_up: bool = False, break_between_layers: bool = False):
        super().__init__()
        self.head_kind, self.break_between_layers = head, break_between_layers
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(break_after_up) for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        if head == "linear":
            self.head = nn.Linear(DIM, VOCAB, bias=False)
        elif head == "own_frame":
            self.head = OwnFrameHead()

    def forward(self, ids):
        h = self.layers[0](self.embed(ids))
        if self.break_between_layers:
            torch._dynamo.graph_break()  # (not inside a loop: Dynamo would run the whole frame eagerly)
        h = self.norm(self.layers[1](h))
        return F.linear(h, self.embed.weight) if self.head_kind == "tied" else self.head(h)


def _tiny_lm(**kwargs) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(**kwargs).to(torch.bfloat16)


IDS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


def _linear_pass(fn, *args, options=OPTIONS) -> dict:
    torch._dynamo.reset()
    with moepass.collecting() as report:
        torch.compile(fn, backend="moepass", options=options)(*args)
    (linear,) = [p for p in report.to_dict()["passes"] if p["name"] == "linear"]
    return linear


def _kept(linear: dict) -> dict:
    return {s["module"]: s["reason"] for s in linear["skipped"]}


def test_a_linear_ending_a_graph_at_a_break_stays_eligible_and_the_head_is_found_by_the_vocabulary():
    linear = _linear_pass(_tiny_lm(break_after_up=True, break_between_layers=True), IDS)
    kept = _kept(linear)
    assert list(kept) == ["head"] and f"N={VOCAB} is the vocabulary size (the rows of embed)" in kept["head"]
    # Block's frames are compiled once and serve both layers: up (which ends its graph at the break) and down
    assert sorted(r["module"] for r in linear["rewrites"]) == ["layers.0.down", "layers.0.up"]
    (up,) = [r for r in linear["rewrites"] if r["module"] == "layers.0.up"]
    assert "the last GEMM of its graph, with no sign of the output head" in up["detail"]


def test_the_finder_records_why_a_graph_end_is_no_head(dynamo_graphs):
    model = _tiny_lm(break_after_up=True)
    torch._dynamo.reset()
    graphs = dynamo_graphs(model, IDS)
    with module_paths.indexing():  # full module paths, as during a backend call
        roles = {m.module: (m.role, m.why) for gm in graphs for m in find_linears(gm)}
    assert roles["layers.0.up"][0] is None and "no sign of the output head" in roles["layers.0.up"][1]
    assert roles["head"][0] == "output_head" and "vocabulary size" in roles["head"][1]


def test_tied_embeddings_name_the_head_by_its_weight():
    """The head computed in the model's own forward with the embedding's weight: its module is the weight's, not ''."""
    kept = _kept(_linear_pass(_tiny_lm(head="tied"), IDS))
    assert list(kept) == ["embed"] and "its weight is the embedding's (embed): tied" in kept["embed"]


def test_a_head_feeding_the_loss_in_the_compiled_region_is_known_by_the_loss():
    model = _tiny_lm()

    def loss(ids):
        return F.cross_entropy(model(ids[:, :-1]).float().flatten(0, 1), ids[:, 1:].flatten())

    kept = _kept(_linear_pass(loss, IDS))
    assert list(kept) == ["head"] and "its output feeds the loss (cross_entropy)" in kept["head"]


def test_a_head_in_a_frame_of_its_own_is_reported_under_its_module_path():
    linear = _linear_pass(_tiny_lm(head="own_frame"), IDS)
    kept = _kept(linear)
    assert list(kept) == ["head"] and "vocabulary size" in kept["head"]
    assert linear["replaced"] == 4 and all(r["module"] for r in linear["rewrites"])  # every GEMM named, none ''


def test_the_last_gemm_of_an_expert_compiled_apart_stays_eligible():
    """experts.0.w2 ends a frame Dynamo resumed inside the expert after a break, and is returned by it: not the
    model's return, so no head."""
    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(HIDDEN, DIM, bias=False)

        def forward(self, x):
            h = F.silu(self.w1(x))
            torch._dynamo.graph_break()
            return self.w2(h)

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.experts = nn.ModuleList([Expert()])

        def forward(self, ids):
            h = self.embed(ids)
            return h + self.experts[0](h)

    torch.manual_seed(0)
    linear = _linear_pass(Experts().to(torch.bfloat16), IDS)
    assert linear["replaced"] == 2 and linear["skipped"] == []


def test_a_model_without_embedding_or_loss_keeps_its_returned_last_gemm_and_says_it_is_unsure():
    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, 32, bias=False)

        def forward(self, x):
            return self.out(x + self.body(x))

    kept = _kept(_linear_pass(Regressor().to(torch.bfloat16), torch.randn(16, DIM, dtype=torch.bfloat16)))
    assert list(kept) == ["out"] and "judged by position only" in kept["out"]


def test_keep_output_head_bf16_off_rewrites_the_head():
    linear = _linear_pass(_tiny_lm(), IDS, options={**OPTIONS, "lowp.keep_output_head_bf16": False})
    assert linear["replaced"] == 5 and linear["skipped"] == []


def test_ddp_buckets_do_not_make_interior_linears_heads(monkeypatch):
    """DDP's graph splitting hands the backend one subgraph per bucket, each ending at an interior linear."""
    import torch.distributed as dist

    from helpers import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 4096)  # small buckets: a few per layer
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(_tiny_lm(), bucket_cap_mb=0.01)
        torch._dynamo.reset()
        with moepass.collecting() as report:
            torch.compile(model, backend="moepass", options=OPTIONS)(IDS)
        d = report.to_dict()
    finally:
        dist.destroy_process_group()
    (linear,) = [p for p in d["passes"] if p["name"] == "linear"]
    assert d["graphs"] > 2  # split at bucket boundaries
    kept = _kept(linear)
    assert list(kept) == ["module.head"] and "vocabulary size" in kept["module.head"]
    assert [s for s in linear["skipped"] if s["reason"].startswith("output head")] == linear["skipped"]
    assert linear["replaced"] == 4
    assert all(SkipCode.OUTPUT_HEAD.phrase in r for r in kept.values())


# ---------------------------------------------------------------- MoE layers compiled on their own (issue 51)
# A MoE layer has no vocabulary: compiled alone (as a MoE layer is benchmarked), its GEMMs end the model, yet none is
# its output head. An expert's GEMM never is; a linear whose output the model returns only combined with other GEMMs'
# outputs is a layer's output.


def _passes(fn, *args, context=None) -> dict:
    torch._dynamo.reset()
    with context or contextlib.nullcontext(), moepass.collecting() as report:
        torch.compile(fn, backend="moepass", options=OPTIONS)(*args)
    return {p["name"]: p for p in report.to_dict()["passes"]}


def test_torchtune_moe_layer_compiled_alone_has_every_expert_and_shared_expert_gemm_rewritten():
    """torchtune's MoE (loop experts `x_e @ W[e]`, a FeedForward shared expert, the routed outputs scatter_add-ed
    into the shared expert's) as the whole compiled model."""
    import torchtune_moe

    moe_package = torchtune_moe.load()
    feed_forward = importlib.import_module("torchtune.modules.feed_forward")
    torch.manual_seed(0)
    experts = 4
    layer = torchtune_moe.llama4_moe(moe_package, feed_forward, DIM, 32, experts, 2)
    layer.experts.reset_parameters()  # torchtune leaves its expert stacks torch.empty
    x = torch.randn(2, 16, DIM, dtype=torch.bfloat16)
    linear = _passes(layer.to(torch.bfloat16), x, context=torchtune_moe.integer_histc_on_cpu())["linear"]
    kept = _kept(linear)
    assert list(kept) == ["router.gate"] and SkipCode.ROUTER_GATE.phrase in kept["router.gate"]
    rewritten = [r["module"] for r in linear["rewrites"]]
    assert sorted(set(rewritten)) == ["experts", "shared_expert.w1", "shared_expert.w2", "shared_expert.w3"]
    assert rewritten.count("experts") == 3 * experts  # gate, up and down projection of each expert
    details = [r["detail"] for r in linear["rewrites"]]
    downs = [d for d in details if "never the output head" in d]
    assert len(downs) == experts and all(f"stacked expert weight [{experts}, 32, {DIM}]" in d for d in downs)
    (w2,) = [r["detail"] for r in linear["rewrites"] if r["module"] == "shared_expert.w2"]
    assert "combined with other GEMMs' outputs (by scatter_add" in w2


def test_the_projects_moe_layer_compiled_alone_has_every_expert_and_shared_expert_gemm_rewritten():
    from moepass.models import MoE, get_config

    torch.manual_seed(0)
    layer = MoE(get_config("debug"))
    layer.init_weights(0.02, 0.02)
    x = torch.randn(2, 16, layer.router.gate.weight.shape[1], dtype=torch.bfloat16)
    passes = _passes(layer.to(torch.bfloat16), x)
    assert passes["grouped_mm"]["replaced"] == 3 and passes["grouped_mm"]["skipped"] == []  # w1, w3, w2 of experts
    kept = _kept(passes["linear"])
    assert list(kept) == ["router.gate"] and SkipCode.ROUTER_GATE.phrase in kept["router.gate"]
    assert sorted(r["module"] for r in passes["linear"]["rewrites"]) == [
        "shared_experts.w1", "shared_experts.w2", "shared_experts.w3"]


def test_a_plain_stack_of_linears_keeps_its_returned_last_linear_as_head_by_position():
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(DIM, HIDDEN, bias=False), nn.SiLU(), nn.Linear(HIDDEN, HIDDEN, bias=False),
                          nn.SiLU(), nn.Linear(HIDDEN, 32, bias=False)).to(torch.bfloat16)
    linear = _linear_pass(stack, torch.randn(16, DIM, dtype=torch.bfloat16))
    kept = _kept(linear)
    assert list(kept) == ["4"] and "judged by position only" in kept["4"]
    assert sorted(r["module"] for r in linear["rewrites"]) == ["0", "2"]


class ExpertsAtTheEnd(nn.Module):
    """An embedding, then experts `x_e @ W[e]` whose outputs the model returns: N is the vocabulary size, and with one
    expert (one local expert under expert parallelism) nothing combines its output with another GEMM's."""

    def __init__(self, experts: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.w = nn.Parameter(torch.randn(experts, DIM, VOCAB) / 8)

    def forward(self, ids):
        h = self.embed(ids).flatten(0, 1)
        if self.w.shape[0] == 1:
            return h @ self.w[0]
        return torch.cat([x_e @ self.w[e] for e, x_e in enumerate(h.chunk(self.w.shape[0]))])


@pytest.mark.parametrize("experts", [1, 4])
def test_an_expert_gemm_at_the_end_of_a_model_is_no_head(experts):
    torch.manual_seed(0)
    linear = _linear_pass(ExpertsAtTheEnd(experts).to(torch.bfloat16), IDS)
    assert linear["skipped"] == [] and linear["replaced"] == experts
    assert all("an expert's GEMM" in r["detail"] and "never the output head" in r["detail"]
               for r in linear["rewrites"])


def test_a_returned_gemm_on_a_weight_held_in_another_shape_is_no_head_by_position():
    """`x @ W.view(K, N)` on a [2, K/2, N] parameter: no expert's slice, and no plain linear's 2-D weight either."""
    class Reshaped(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, DIM // 2, 32) / 8)

        def forward(self, x):
            return x @ self.w.view(DIM, 32)

    torch.manual_seed(0)
    linear = _linear_pass(Reshaped().to(torch.bfloat16), torch.randn(16, DIM, dtype=torch.bfloat16))
    assert linear["skipped"] == [] and linear["replaced"] == 1
    assert "read from a 3-D parameter" in linear["rewrites"][0]["detail"]
