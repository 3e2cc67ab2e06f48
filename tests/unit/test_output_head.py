"""The output head is known by what it is (vocabulary-sized, tied to the embedding, feeding the loss, returned by the
model), not by where a graph ends: a linear that ends a graph cut by a graph break, a frame Dynamo compiled apart or
a DDP bucket stays eligible, and the head is reported under its module path, never ''."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass.analysis import module_paths
from moepass.passes.linear import find_linears
from moepass.report.skips import SkipCode

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
