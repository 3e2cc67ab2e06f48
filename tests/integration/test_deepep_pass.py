"""The deepep pass: EP all-to-all regions -> moepass::ep_dispatch / ep_combine, on gloo CPU ranks.

Rank checks run in spawned processes kept across tests (helpers.RankPools: a failed or hung
check fails the test within its timeout). Besides moepass.models, the pass is run on an EP MoE
written the way torchtitan writes it (ExpertParallel hooks, searchsorted permutation, setitem
unpermute, score_before_experts either way) and on Megatron-style code (in-place
dist.all_to_all_single, the token exchange inside an autograd.Function).

Tolerances: with `inductor=False` the rewritten graph runs eagerly and its outputs and gradients are
compared bit for bit with the uncompiled model (top-2 routing: each token's two expert rows are summed
in the same order as the original). With Inductor, fused bf16 arithmetic differs from eager as it does
without the pass: logits rtol=2e-2, atol=6e-2 and gradients within 1/32 of their max, as
test_model_ep uses for compiled-vs-eager.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from helpers import rank_pool  # noqa: F401  (a fixture)
from torch import nn

from moepass.dynamo_flags import FLAGS

VOCAB = 2048
NO_A2A = ("all_to_all_single", "wait_tensor")


def _capture(fn, *args) -> list[torch.fx.GraphModule]:
    graphs = []
    torch._dynamo.reset()
    with torch._dynamo.config.patch(FLAGS):  # what moepass traces its frames with; this capturing backend gets none
        torch.compile(fn, backend=lambda gm, _: graphs.append(gm) or gm.forward)(*args)
    return graphs


def _run(fn, x, options=None, compile_=True):
    """(output, grads of parameters and of float inputs, report) of one forward + backward."""
    import moepass

    module = fn if isinstance(fn, nn.Module) else None
    if module is not None:
        module.zero_grad(set_to_none=True)
    if x.is_floating_point():
        x = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    with moepass.collecting() as report:
        out = torch.compile(fn, backend="moepass", options=options)(x) if compile_ else fn(x)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        (out.float() * g.float()).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()} if module is not None else {}
    if x.is_floating_point():
        grads["<input>"] = x.grad.clone()
    return out.detach(), grads, report.to_dict()


def _assert_bitwise(got, want):
    (out, grads, _), (ref_out, ref_grads, _) = got, want
    assert torch.equal(out, ref_out), f"outputs differ by {(out.float() - ref_out.float()).abs().max()}"
    assert grads.keys() == ref_grads.keys()
    differ = [n for n in grads if not torch.equal(grads[n], ref_grads[n])]
    assert not differ, f"gradients differ: {differ}"


def _deepep(report) -> dict:
    return next(p for p in report["passes"] if p["name"] == "deepep")


def _all_to_alls_left(report) -> int:
    return sum(v for k, v in report["ops_after"].items() if "all_to_all_single" in k)


# ---------------------------------------------------------------- the pair op and the backend's flags


def test_expert_major_pairs_lists_each_local_expert_then_row():
    import moepass.ops.ep.permute  # noqa: F401

    recv_topk_idx = torch.tensor([[1, -1], [0, 1], [-1, -1], [0, -1]])
    pair_row, pair_slot = torch.ops.moepass.ep_expert_major_pairs(recv_topk_idx, 2)
    # expert 0: rows 1 (k=0) and 3 (k=0); expert 1: rows 0 (k=0) and 1 (k=1); row 2 has none here
    assert pair_slot.tolist() == [2, 6, 0, 3]
    assert pair_row.tolist() == [1, 3, 0, 1]


def test_expert_major_pairs_fake_size_is_unbacked():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    import moepass.ops.ep.permute  # noqa: F401

    with FakeTensorMode(shape_env=ShapeEnv()):
        pair_row, pair_slot = torch.ops.moepass.ep_expert_major_pairs(torch.empty(5, 2, dtype=torch.int64), 4)
    (num_pairs,) = free_unbacked_symbols(pair_row.shape[0])
    assert free_unbacked_symbols(pair_slot.shape[0]) == {num_pairs}


def test_importing_the_backend_leaves_the_capture_flags_off():
    """EP graphs get them per frame, inside moepass's compiles only (tests/unit/test_dynamo_flags.py): set process-wide they
    would change every other compile."""
    code = ("import torch; c = torch._dynamo.config; assert not c.capture_scalar_outputs; "
            "import moepass.backend; print(c.capture_scalar_outputs, c.capture_dynamic_output_shape_ops)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("TORCHDYNAMO_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_graph_without_all_to_alls_is_left_untouched():
    from moepass.analysis.ep_region import find_ep_regions
    from moepass.models import MoE, get_config
    from moepass.options import Config
    from moepass.passes import deepep
    from moepass.report.records import PassRecord

    moe = MoE(get_config("debug"))
    (gm,) = _capture(moe, torch.randn(2, 8, 256, dtype=torch.bfloat16))
    code = gm.code
    assert find_ep_regions(gm) == ([], [])
    record = PassRecord("deepep")
    deepep.run(gm, Config.from_options({}), record)
    assert (record.rewrites, record.skipped, gm.code) == ([], [], code)


# ---------------------------------------------------------------- moepass.models under EP


def _debug_model(n_layers: int):
    from moepass.models import build_model

    torch.manual_seed(0)
    return build_model("debug", n_layers=n_layers, ep_group=dist.group.WORLD)


def _tokens(rank):
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))


def check_finder_finds_one_region_per_moe_layer(rank, world_size):
    import moepass.backend  # noqa: F401  (sets the capture flags, as torch.compile(backend="moepass") would)
    from moepass.analysis.ep_region import find_ep_regions
    from moepass.analysis.node_module import module_path

    model = _debug_model(n_layers=3)
    (gm,) = _capture(model, _tokens(rank))
    regions, skips = find_ep_regions(gm)
    assert skips == []
    assert [r.module for r in regions] == ["layers.1.moe", "layers.2.moe"]
    for r in regions:
        assert (r.num_experts, r.group_size, r.group_name) == (8, world_size, dist.group.WORLD.group_name)
        assert r.weights_applied == "after_experts"  # MoE.forward weights the combined rows
        assert {a.form for a in (r.counts_a2a, r.token_a2a, r.combine_a2a)} == {"functional"}
        assert r.token_a2a.output_splits == r.combine_a2a.input_splits
        assert tuple(r.topk_ids.meta["example_value"].shape) == (32, 2)
        assert r.topk_weights.meta["example_value"].dtype == torch.float32
        assert module_path(r.x) == r.module and r.x.meta["example_value"].shape == (32, 256)
        assert sum(1 for u in r.expert_input.users if u.target is torch._grouped_mm) == 2  # gate and up
        assert r.expert_output.target is torch._grouped_mm  # down
        assert r.tokens_out.target == "index_add"
        assert r.checked_routings >= 3


def test_finder_finds_one_region_per_moe_layer(rank_pool):
    rank_pool(2).run(check_finder_finds_one_region_per_moe_layer)


def check_debug_model_matches_uncompiled(rank, world_size, inductor):
    model = _debug_model(n_layers=3 if not inductor else 2)
    tokens = _tokens(rank)
    want = _run(model, tokens, compile_=False)
    got = _run(model, tokens, {"passes": ["deepep"], "inductor": inductor})
    report = got[2]
    assert report["graphs"] == 1  # no graph break inside the MoE blocks
    deepep = _deepep(report)
    moe_layers = 2 if not inductor else 1
    assert deepep["replaced"] == moe_layers and deepep["skipped"] == []
    assert [r["module"] for r in deepep["rewrites"]] == [f"layers.{i}.moe" for i in range(1, moe_layers + 1)]
    for r in deepep["rewrites"]:
        assert "backend=reference" in r["detail"] and "weights after experts" in r["detail"], r
    assert deepep["implementations"] == {"reference": "tensors are on cpu; DeepEP needs CUDA GPUs"}
    ops = report["ops_after"]
    assert not [k for k in ops if k.endswith(NO_A2A)], ops
    assert ops["moepass.ep_dispatch"] == ops["moepass.ep_combine"] == moe_layers
    if not inductor:
        _assert_bitwise(got, want)
        return
    (out, grads, _), (ref_out, ref_grads, _) = got, want
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=6e-2)
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().float()
        assert (grad.float() - ref_grads[name].float()).abs().max() <= scale / 32, name


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_debug_model_rewritten_matches_uncompiled_bitwise(world_size, rank_pool):
    rank_pool(world_size).run(check_debug_model_matches_uncompiled, False, timeout_s=300)


@pytest.mark.extended  # ~60 s; CI compiles EP regions with Inductor in test_model_ep.py and the catalogs
def test_debug_model_with_inductor_matches_uncompiled(rank_pool):
    rank_pool(2).run(check_debug_model_matches_uncompiled, True, timeout_s=580)


def check_all_passes_match_mxfp8_without_deepep(rank, world_size):
    model = _debug_model(n_layers=2)
    tokens = _tokens(rank)
    want = _run(model, tokens, {"passes": ["mxfp8_grouped_mm", "mxfp8_linear"], "inductor": False})
    from moepass.options import DEFAULT_PASSES

    everything = list(DEFAULT_PASSES)
    got = _run(model, tokens, {"passes": [p for p in everything if p != "weights_before_gemm"], "inductor": False})
    passes = {p["name"]: p for p in got[2]["passes"]}
    assert passes["deepep"]["replaced"] == 1
    # the grouped GEMMs, now fed the dispatched (row, expert) pairs, are still recognised
    assert passes["grouped_mm"]["replaced"] == 3 and passes["grouped_mm"]["skipped"] == []
    # same rows per expert, in the same order: the MXFP8 blocks (also the 1x32 token blocks of wgrad) agree
    _assert_bitwise(got, want)

    # with every default pass: the deepep pass weights the experts' received-order output rows, which is what
    # weights_before_gemm moves onto the down projection's input; MXFP8 then quantizes weighted rows (other codes),
    # so the check is against BF16: no further from it than the rewrite without the moved weight
    moved = _run(model, tokens, {"passes": everything, "inductor": False})
    record = {p["name"]: p for p in moved[2]["passes"]}["weights_before_gemm"]
    assert [r["module"] for r in record["rewrites"]] == ["layers.1.moe.experts"], record
    bf16 = _run(model, tokens, {"passes": ["deepep"], "inductor": False})

    def err(run, name=None):
        a, b = (run[0], bf16[0]) if name is None else (run[1][name], bf16[1][name])
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert err(moved) <= 1.5 * err(got) + 1e-3, (err(moved), err(got))
    for name in got[1]:
        assert err(moved, name) <= 1.5 * err(got, name) + 1e-3, (name, err(moved, name), err(got, name))


def test_all_passes_equal_mxfp8_passes_without_deepep(rank_pool):
    rank_pool(2).run(check_all_passes_match_mxfp8_without_deepep, timeout_s=300)


# ---------------------------------------------------------------- an independent EP MoE, torchtitan style


class TitanExperts(nn.Module):
    """torchtitan GroupedExperts with _run_experts_grouped_mm (bf16 grouped GEMMs, type_as at the end)."""

    def __init__(self, num_local_experts, dim, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_local_experts, hidden, dim, dtype=torch.bfloat16) * 0.05)
        self.w2 = nn.Parameter(torch.randn(num_local_experts, dim, hidden, dtype=torch.bfloat16) * 0.05)
        self.w3 = nn.Parameter(torch.randn(num_local_experts, hidden, dim, dtype=torch.bfloat16) * 0.05)

    def forward(self, x, num_tokens_per_expert):
        offsets = torch.cumsum(num_tokens_per_expert, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


def _generate_permute_indices(tokens_per_expert_group, experts_per_rank, num_ranks, max_len):
    """torchtitan's rank-major -> expert-major permutation without padding (searchsorted)."""
    start_index_values = tokens_per_expert_group.cumsum(0) - tokens_per_expert_group
    t_mat = tokens_per_expert_group.view(num_ranks, experts_per_rank)
    m_sizes = t_mat.sum(0)
    lens = t_mat.t().reshape(-1)
    starts = start_index_values.view(num_ranks, experts_per_rank).t().reshape(-1)
    out_starts = lens.cumsum(0) - lens
    out_ends = out_starts + lens
    bias = starts - out_starts
    p = torch.arange(max_len, device=tokens_per_expert_group.device)
    seg = torch.searchsorted(out_ends, p, right=True)
    return p + bias[seg], m_sizes


class MegatronAllToAll(torch.autograd.Function):
    """Megatron-LM's _AllToAll: in-place dist.all_to_all_single, backward = the reverse exchange."""

    @staticmethod
    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        ctx.group, ctx.output_split_sizes, ctx.input_split_sizes = group, output_split_sizes, input_split_sizes
        input = input.contiguous()
        output = input.new_empty(size=[sum(output_split_sizes)] + list(input.size()[1:]))
        dist.all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return output

    @staticmethod
    def backward(ctx, grad):
        return None, MegatronAllToAll.apply(ctx.group, grad, ctx.input_split_sizes, ctx.output_split_sizes), None, None


class TitanExpertParallel:
    """torchtitan ExpertParallel as forward hooks on the experts (input_fn = dispatch, output_fn = combine).

    megatron=True exchanges the counts with in-place dist.all_to_all_single and the tokens with MegatronAllToAll.
    """

    def __init__(self, group, megatron=False, leak_expert_output=False):
        self.group, self.megatron, self.leak_expert_output = group, megatron, leak_expert_output

    def apply(self, experts: nn.Module) -> None:
        experts.register_forward_pre_hook(self._token_dispatch)
        experts.register_forward_hook(self._token_combine)

    def _all_to_all(self, rows, output_splits, input_splits):
        if self.megatron:
            return MegatronAllToAll.apply(self.group, rows, output_splits, input_splits)
        return funcol.all_to_all_single_autograd(rows, output_splits, input_splits, self.group)

    def _token_dispatch(self, mod, inputs):
        routed_input, num_tokens_per_expert = inputs
        ep_degree = self.group.size()
        num_local_experts = num_tokens_per_expert.shape[0] // ep_degree
        with torch.no_grad():
            if self.megatron:
                num_tokens_per_expert_group = torch.empty_like(num_tokens_per_expert)
                dist.all_to_all_single(num_tokens_per_expert_group, num_tokens_per_expert, group=self.group)
            else:
                num_tokens_per_expert_group = funcol.all_to_all_single(num_tokens_per_expert, None, None, self.group)
                num_tokens_per_expert_group = torch.ops._c10d_functional.wait_tensor(num_tokens_per_expert_group)
            input_splits = num_tokens_per_expert.view(ep_degree, -1).sum(dim=1).to(torch.device("cpu"))
            output_splits = num_tokens_per_expert_group.view(ep_degree, -1).sum(dim=1).to(torch.device("cpu"))
            self.input_splits, self.output_splits = input_splits.tolist(), output_splits.tolist()
        routed_input = self._all_to_all(routed_input, self.output_splits, self.input_splits)
        with torch.no_grad():
            self.permuted_indices, num_tokens_per_expert_group = _generate_permute_indices(
                num_tokens_per_expert_group, num_local_experts, ep_degree, routed_input.shape[0])
        self.input_shape = routed_input.shape
        return routed_input[self.permuted_indices, :], num_tokens_per_expert_group

    def _token_combine(self, mod, inputs, routed_output):
        if self.leak_expert_output:
            self.expert_output_norm = routed_output.float().square().mean()
        out_unpermuted = routed_output.new_empty(self.input_shape)
        out_unpermuted[self.permuted_indices, :] = routed_output
        return self._all_to_all(out_unpermuted, self.input_splits, self.output_splits)


class TitanMoE(nn.Module):
    """torchtitan MoE.forward: sigmoid top-k router, histc counts, reorderer, unsort + bmm / sum."""

    def __init__(self, group, score_before_experts, megatron=False, leak_expert_output=False,
                 dim=64, hidden=32, num_experts=8, top_k=2):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False, dtype=torch.bfloat16)
        self.experts = TitanExperts(num_experts // group.size(), dim, hidden)
        self.shared_experts = nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16)
        self.num_experts, self.top_k, self.score_before_experts = num_experts, top_k, score_before_experts
        TitanExpertParallel(group, megatron, leak_expert_output).apply(self.experts)

    def forward(self, x):
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = torch.sigmoid(self.gate(x).to(torch.float32))
        _, selected_experts_indices = torch.topk(scores, k=self.top_k, dim=-1)
        top_scores = scores.gather(dim=1, index=selected_experts_indices)
        # torchtitan histc's int64 ids on GPU; CPU histc takes floats
        num_tokens_per_expert = torch.histc(selected_experts_indices.view(-1).float(), bins=self.num_experts,
                                            min=0, max=self.num_experts).long()
        token_indices_experts_sorted = torch.argsort(selected_experts_indices.view(-1), stable=True)
        top_scores_experts_sorted = top_scores.view(-1)[token_indices_experts_sorted]
        routed_input = x[token_indices_experts_sorted // self.top_k]
        if self.score_before_experts:
            routed_input = (routed_input.to(torch.float32) * top_scores_experts_sorted.reshape(-1, 1)).to(x.dtype)
        routed_output = self.experts(routed_input, num_tokens_per_expert)
        out = self.shared_experts(x)
        unsorted = torch.zeros((bs * slen * self.top_k, dim), dtype=routed_output.dtype, device=routed_output.device)
        unsorted[token_indices_experts_sorted] = routed_output
        unsorted = unsorted.reshape(-1, self.top_k, dim)
        if not self.score_before_experts:
            out_experts = torch.bmm(top_scores.reshape(-1, 1, self.top_k), unsorted.float()).to(x.dtype).squeeze(1)
        else:
            out_experts = unsorted.sum(dim=1)
        return (out + out_experts).reshape(bs, slen, dim)


def check_titan_style_moe(rank, world_size, score_before_experts, megatron):
    import moepass.backend  # noqa: F401  (sets the capture flags, as torch.compile(backend="moepass") would)
    from moepass.analysis.ep_region import find_ep_regions

    torch.manual_seed(0)
    moe = TitanMoE(dist.group.WORLD, score_before_experts, megatron)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()

    (gm,) = _capture(moe, x.detach().requires_grad_())  # as in training: the token exchange needs autograd
    (region,), skips = find_ep_regions(gm)
    assert skips == []
    assert region.weights_applied == ("before_experts" if score_before_experts else "after_experts")
    form = "autograd.Function (in-place)" if megatron else "functional"
    forms = (region.counts_a2a.form, region.token_a2a.form, region.combine_a2a.form)
    assert forms == ("in-place" if megatron else "functional", form, form), forms
    # the first T x D value after the combine: bmm(...) ([T, 1, D], squeezed later), or unsorted.sum(dim=1)
    expected = ("call_method", "sum") if score_before_experts else ("call_function", torch.bmm)
    assert (region.tokens_out.op, region.tokens_out.target) == expected

    want = _run(moe, x, compile_=False)
    got = _run(moe, x, {"passes": ["deepep"], "inductor": False})
    _assert_bitwise(got, want)
    deepep = _deepep(got[2])
    assert deepep["replaced"] == 1 and deepep["skipped"] == []
    # the split sizes are stored on the ExpertParallel object (graph outputs): the counts exchange stays
    assert "counts all-to-all kept" in deepep["rewrites"][0]["detail"]
    assert _all_to_alls_left(got[2]) == 1


@pytest.mark.parametrize("score_before_experts", [True, False], ids=["score-before", "score-after"])
@pytest.mark.parametrize("megatron", [False, True], ids=["functional", "megatron-inplace"])
def test_titan_style_ep_moe_rewritten_bitwise(score_before_experts, megatron, rank_pool):
    rank_pool(2).run(check_titan_style_moe, score_before_experts, megatron)


def check_region_leaking_expert_output_is_left_alone(rank, world_size):
    import moepass.backend  # noqa: F401

    torch.manual_seed(0)
    moe = TitanMoE(dist.group.WORLD, score_before_experts=False, leak_expert_output=True)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
    want = _run(moe, x, compile_=False)
    got = _run(moe, x, {"passes": ["deepep"], "inductor": False})
    _assert_bitwise(got, want)
    deepep = _deepep(got[2])
    assert deepep["replaced"] == 0
    (skip,) = deepep["skipped"]
    assert "outside it" in skip["reason"], skip
    assert _all_to_alls_left(got[2]) == 3


def test_region_whose_expert_output_escapes_is_left_alone_with_reason(rank_pool):
    rank_pool(2).run(check_region_leaking_expert_output_is_left_alone)


class _FromTorchTensor211(torch.autograd.Function):
    """torch <= 2.12's wrapper around all_to_all_single_autograd's output (forward waits, backward passes)."""

    @staticmethod
    def forward(ctx, tensor):
        return funcol._maybe_wrap_tensor(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _all_to_all_single_autograd_211(self, output_split_sizes, input_split_sizes, group, tag=""):
    group_name = funcol._resolve_group_name(group, tag)
    out = torch.ops._c10d_functional_autograd.all_to_all_single(self, output_split_sizes, input_split_sizes, group_name)
    return _FromTorchTensor211.apply(out)


def check_torch_211_token_exchange_form(rank, world_size):
    """The GPU machine's torch 2.11 traces all_to_all_single_autograd to the _c10d_functional_autograd op
    wrapped in autograd_function_apply (with the split SymInts lifted as operands); 2.13 does not."""
    saved = funcol.all_to_all_single_autograd
    funcol.all_to_all_single_autograd = _all_to_all_single_autograd_211
    try:
        model = _debug_model(n_layers=3)
        tokens = _tokens(rank)
        want = _run(model, tokens, compile_=False)
        got = _run(model, tokens, {"passes": ["deepep"], "inductor": False})
    finally:
        funcol.all_to_all_single_autograd = saved
    assert got[2]["ops_before"].get("autograd_function_apply") == 4, got[2]["ops_before"]
    deepep = _deepep(got[2])
    assert deepep["replaced"] == 2 and deepep["skipped"] == [], deepep
    _assert_bitwise(got, want)


def test_torch_211_token_exchange_form_is_rewritten(rank_pool):
    rank_pool(2).run(check_torch_211_token_exchange_form, timeout_s=300)
