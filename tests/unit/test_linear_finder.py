"""The linear finder on small Dynamo graphs: which GEMMs are linears, and their roles."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import moepass
from moepass.passes.linear import find_linears


class TinyMoEBlock(nn.Module):
    """Router gate, projections with a residual add, an x @ W.T form and an attention-score matmul."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 8, bias=False)
        self.wq = nn.Linear(64, 64, bias=False)
        self.up = nn.Parameter(torch.randn(128, 64) * 0.02)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 96, bias=False)

    def forward(self, x):
        scores = F.softmax(self.gate(x).float(), dim=-1)
        _, idx = torch.topk(scores, 2, dim=-1)
        q = self.wq(x)
        att = torch.matmul(q, q.transpose(-2, -1))  # activation @ activation: not a linear
        h = x + att @ q
        h = h + self.down(F.silu(h @ self.up.t())) + idx.sum(-1, keepdim=True).to(h.dtype)
        return self.head(h)


def _roles(graphs):
    (gm,) = graphs
    return {m.module: m.role for m in find_linears(gm)}, find_linears(gm)


def test_roles_router_head_and_plain(dynamo_graphs):
    block = TinyMoEBlock().bfloat16()
    roles, matches = _roles(dynamo_graphs(block, torch.randn(2, 16, 64, dtype=torch.bfloat16)))
    # `h @ self.up.t()` is issued by the block itself: named by its weight, not ''
    assert roles == {"gate": "router", "wq": None, "up": None, "down": None, "head": "output_head"}
    assert len(matches) == 5  # gate, wq, x @ up.t(), down, head; the score matmuls are not linears
    matmul_form = [m for m in matches if m.module == "up"][0]
    assert matmul_form.weight.name.endswith("up_")


def test_no_linears_in_pure_elementwise_graph(dynamo_graphs):
    graphs = dynamo_graphs(lambda x: torch.relu(x) * 2, torch.randn(4, 4))
    assert find_linears(graphs[0]) == []


class SparseMixerRouter(nn.Module):
    """PhiMoE's sparsemixer: expert choice by max and a threshold mask, no top-k; 32 experts (N % 32 == 0)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(64, 32, bias=False)
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        scores = self.gate(x)
        with torch.no_grad():
            threshold, best = scores.max(dim=-1, keepdim=True)
            factor = scores.abs().clamp(min=threshold)
            mask = ((threshold - scores) / factor) > 0.02
        masked = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        weight = masked.gather(-1, best)
        return x + self.proj(x) * weight


def test_router_found_by_what_its_scores_feed_not_by_topk(dynamo_graphs):
    roles, _ = _roles(dynamo_graphs(SparseMixerRouter().bfloat16(), torch.randn(2, 16, 64, dtype=torch.bfloat16)))
    assert roles == {"gate": "router", "proj": None}


def test_max_used_for_values_only_does_not_make_a_router(dynamo_graphs):
    """A max over a linear's output whose indices nobody reads is a normalisation, not expert selection."""
    class MaxNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 64, bias=False)

        def forward(self, x):
            y = self.proj(x)
            return x + y / y.abs().max(dim=-1, keepdim=True).values

    roles, _ = _roles(dynamo_graphs(MaxNorm().bfloat16(), torch.randn(2, 16, 64, dtype=torch.bfloat16)))
    assert roles == {"proj": None}


def test_an_add_of_data_dependent_size_after_a_linear_is_classified_without_a_guard():
    """Megatron's SequentialMLP runs its experts on torch.split(rows, counts.tolist()) chunks: an add of such a
    chunk has an unbacked size. Whether it is a linear's residual add must not guard on it (that failed the
    user's whole compile with GuardOnDataDependentSymNode); unknown means no."""
    import operator

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from moepass.passes.linear import _is_residual_add

    shape_env = ShapeEnv()
    with FakeTensorMode(shape_env=shape_env):
        chunk = torch.empty(shape_env.create_unbacked_symint(), 64)
    graph = torch.fx.Graph()
    add = graph.call_function(operator.add, (graph.placeholder("a"), graph.placeholder("b")))
    add.meta["example_value"] = chunk
    assert _is_residual_add(add, 16 * 64) is False
