"""regather_rows: gathered FP8 rows are gathered again in the backward instead of kept (the finder on small joint
graphs, then a compiled quantize_once model: what its forward keeps, and the same gradients)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

import moepass
import moepass.ops.lowp  # noqa: F401  (registers the ops)
from moepass.inductor_stage import saved_for_backward
from moepass.inductor_stage.regather_rows import find_fp8_row_gathers, mark_fp8_row_gathers_recomputed
from helpers import scaled_grouped_mm_on_cpu, scaled_mm_on_cpu  # noqa: F401  (fixtures)

aten = torch.ops.aten
BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def _joint(rows_dtype=E4M3, token_rows=4, gathered=12, read_in_backward=True, select=False, tagged=False,
           with_gradient=True):
    """A joint graph: forward `rows[index]` (and the scales by the same index) into an op, backward an op reading
    the gathered rows, with the incoming gradient or (with_gradient=False) alone, as the wgrad's quantization of x
    does, its result meeting the gradient after."""
    graph = torch.fx.Graph()
    mode = FakeTensorMode()
    with mode:
        vals = {"primals_1": torch.empty(token_rows, 8, dtype=rows_dtype), "primals_2": torch.empty(token_rows, 1),
                "primals_3": torch.zeros(gathered, dtype=torch.int64), "tangents_1": torch.empty(gathered, 8)}
    nodes = {}
    for name, val in vals.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = val

    def gather(src):
        node = (graph.call_function(aten.index_select.default, (src, 0, nodes["primals_3"])) if select else
                graph.call_function(aten.index.Tensor, (src, [nodes["primals_3"]])))
        with mode:
            node.meta["val"] = vals[src.name][vals["primals_3"]]
        return node

    rows, scales = gather(nodes["primals_1"]), gather(nodes["primals_2"])
    if tagged:
        rows.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    forward = graph.call_function(aten.mul.Tensor, (rows, scales))
    grad = graph.call_function(aten.mul.Tensor, (scales, nodes["tangents_1"]))
    if not read_in_backward:
        backward = grad
    elif with_gradient:
        backward = graph.call_function(aten.mul.Tensor, (rows, grad))
    else:
        backward = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.abs.default, (rows,)), grad))
    graph.output((forward, backward))
    return graph, rows, scales


@pytest.mark.parametrize("with_gradient", [True, False], ids=["with_gradient", "alone"])
@pytest.mark.parametrize("select", [False, True], ids=["getitem", "index_select"])
def test_fp8_rows_and_their_scales_read_by_the_backward_are_gathered_again(select, with_gradient):
    graph, rows, scales = _joint(select=select, with_gradient=with_gradient)
    found = mark_fp8_row_gathers_recomputed(graph)
    assert [g.node for g in found] == [rows, scales]
    assert rows.meta["recompute"] == scales.meta["recompute"] == CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("case", [
    dict(rows_dtype=BF16),  # BF16 rows: the partitioner's own choice stands
    dict(read_in_backward=False),  # the backward reads only the scales: nothing of the rows is kept
    dict(token_rows=16, gathered=12),  # fewer rows than the source: keeping the gather is smaller
    dict(tagged=True),  # another policy (activation checkpointing) decided already
], ids=["bf16", "forward_only", "shrinks", "tagged"])
def test_what_is_left_to_the_partitioner(case):
    graph, rows, _ = _joint(**case)
    found = {g.node for g in find_fp8_row_gathers(graph)}
    assert rows not in found
    if case.get("tagged"):
        assert rows.meta["recompute"] == CheckpointPolicy.MUST_SAVE


class Experts(torch.nn.Module):
    def __init__(self, dim: int = 128, inter: int = 64, experts: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.w1, self.w3 = (torch.nn.Parameter((torch.randn(experts, inter, dim, generator=g) / 12).to(BF16))
                            for _ in "13")
        self.w2 = torch.nn.Parameter((torch.randn(experts, dim, inter, generator=g) / 12).to(BF16))

    def forward(self, x, idx, offs):
        rows = x[idx]
        h = F.silu(torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offs))
        h = h * torch._grouped_mm(rows, self.w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offs)


def _train_once(monkeypatch, regather: bool, kernel: str = "emulated"):
    if not regather:
        monkeypatch.setattr(saved_for_backward, "mark_fp8_row_gathers_recomputed", lambda graph: [])
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 128, generator=g).to(BF16).requires_grad_()
    idx, offs = torch.randint(0, 10, (40,), generator=g), torch.tensor([12, 30, 40], dtype=torch.int32)
    model = Experts()
    options = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": kernel, "fp8_rowwise.wgrad_bf16": False,
               "passes": ["grouped_mm", "quantize_once"]}
    compiled = torch.compile(model, backend="moepass", options=options)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        out = compiled(x, idx, offs)
    out.float().square().sum().backward()
    return kept, [t.grad for t in (x, model.w1, model.w2, model.w3)]


@pytest.fixture(params=["emulated", "scaled_mm"])
def kernel(request):
    """emulated: the ops as they run on CPU; scaled_mm: decomposed as on the GPU (the wgrad's token-group quantization
    reading the gathered rows; torch._scaled_grouped_mm by a CPU stand-in)."""
    if request.param == "scaled_mm":
        request.getfixturevalue("scaled_grouped_mm_on_cpu")
    return request.param


def test_a_compiled_quantize_once_model_keeps_the_token_rows_not_the_gathered_ones(monkeypatch, kernel):
    kept, grads = _train_once(monkeypatch, True, kernel)
    assert (E4M3, (10, 128)) in kept and (E4M3, (40, 128)) not in kept, kept
    kept_before, grads_before = _train_once(monkeypatch, False, kernel)
    assert (E4M3, (40, 128)) in kept_before, kept_before  # what the partitioner keeps without the pass
    for got, want in zip(grads[1:], grads_before[1:]):
        assert torch.equal(got, want)  # the wgrads read the same rows, gathered again
    # the rows' gradient is the same sum; the backward graph it is fused into differs, so its BF16 rounding may
    rel = (grads[0].float() - grads_before[0].float()).norm() / grads_before[0].float().norm()
    assert rel < 1e-2, rel
