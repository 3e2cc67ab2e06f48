"""DeepSeek-V3 reference model (moepass.models): configs, semantics, training, compile."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from moepass.models import FLAVORS, DeepSeekV3Config, MoE, build_model, get_config
from moepass.models.moe import TopKRouter
from moepass.models.rope import RotaryEmbedding, apply_rotary_emb, yarn_inv_freq, yarn_softmax_scale


def _tokens(batch: int, seq_len: int, vocab: int = 2048, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- configs


def test_flavors_carry_published_numbers():
    v3 = get_config("671B")  # DeepSeek-V3 inference/configs/config_671B.json
    assert (v3.vocab_size, v3.dim, v3.inter_dim, v3.moe_inter_dim) == (129280, 7168, 18432, 2048)
    assert (v3.n_layers, v3.n_dense_layers, v3.n_heads) == (61, 3, 128)
    assert (v3.n_routed_experts, v3.n_shared_experts, v3.n_activated_experts) == (256, 1, 8)
    assert (v3.n_expert_groups, v3.n_limited_groups, v3.route_scale, v3.score_func) == (8, 4, 2.5, "sigmoid")
    assert v3.route_norm
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim) == (
        1536, 512, 128, 64, 128
    )
    assert (v3.rope_factor, v3.original_seq_len, v3.beta_fast, v3.beta_slow, v3.mscale) == (40.0, 4096, 32, 1, 1.0)

    lite = get_config("16B")  # config_16B.json / torchtitan _16b
    assert (lite.vocab_size, lite.dim, lite.inter_dim, lite.moe_inter_dim, lite.n_layers) == (102400, 2048, 10944, 1408, 27)
    assert (lite.n_dense_layers, lite.n_heads, lite.n_routed_experts, lite.n_shared_experts) == (1, 16, 64, 2)
    assert (lite.n_activated_experts, lite.score_func, lite.q_lora_rank, lite.kv_lora_rank) == (6, "softmax", 0, 512)
    assert (lite.n_expert_groups, lite.mscale) == (1, 0.707)

    v2 = get_config("236B")  # config_236B.json
    assert (v2.dim, v2.n_layers, v2.n_heads, v2.n_routed_experts, v2.n_activated_experts) == (5120, 60, 128, 160, 6)
    assert (v2.n_expert_groups, v2.n_limited_groups, v2.route_scale, v2.q_lora_rank) == (8, 3, 16.0, 1536)


@pytest.mark.parametrize("flavor, published_billions, tol", [("16B", 15.7, 0.05), ("236B", 236, 0.5), ("671B", 671, 0.5)])
def test_flavor_parameter_count_matches_published_total(flavor, published_billions, tol):
    # DeepSeek-V2-Lite 15.7B, DeepSeek-V2 236B, DeepSeek-V3 671B (main model, no MTP)
    with torch.device("meta"):
        model = build_model(flavor)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    assert abs(total - published_billions) < tol, total


def test_unknown_flavor_and_override_raise_value_error():
    with pytest.raises(ValueError, match="flavor"):
        get_config("7B")
    with pytest.raises(ValueError, match="n_expertz"):
        get_config("debug", n_expertz=4)
    with pytest.raises(ValueError, match="n_expertz"):
        build_model("debug", n_expertz=4)
    with pytest.raises(ValueError, match="n_limited_groups"):
        get_config("debug", n_limited_groups=3)
    assert get_config("debug", n_layers=2).n_layers == 2
    assert FLAVORS["debug"].n_layers == 4  # overrides never mutate the registry


def test_debug_flavor_gemm_dims_are_multiples_of_32():
    for q_lora_rank in (0, 64):
        model = build_model("debug", q_lora_rank=q_lora_rank)
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("router.gate"):
                assert module.in_features % 32 == 0 and module.out_features % 32 == 0, name
        for name, param in model.named_parameters():
            if ".experts." in name:
                assert param.shape[1] % 32 == 0 and param.shape[2] % 32 == 0, name


# ---------------------------------------------------------------- model


def test_forward_shape_and_finite_grads_for_all_params():
    torch.manual_seed(0)
    model = build_model("debug")
    tokens = _tokens(2, 32)
    logits = model(tokens)
    assert logits.shape == (2, 32, 2048) and logits.dtype == torch.bfloat16
    F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    layer_kinds = ["moe" if layer.moe_enabled else "dense" for layer in model.layers]
    assert layer_kinds == ["dense", "moe", "moe", "moe"]
    assert model.layers[1].moe.experts.w1.shape == (8, 128, 256)


def test_q_lora_variant_builds_low_rank_query_and_trains():
    torch.manual_seed(0)
    model = build_model("debug", q_lora_rank=64)
    attention = model.layers[0].attention
    assert not hasattr(attention, "wq")
    assert attention.wq_a.weight.shape == (64, 256) and attention.wq_b.weight.shape == (4 * 64, 64)
    tokens = _tokens(2, 16)
    F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
    for name in ("wq_a", "wq_b", "q_norm"):
        grad = getattr(attention, name).weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_init_weights_is_torchtitan_style():
    torch.manual_seed(0)
    model = build_model("debug")
    assert torch.all(model.norm.weight == 1) and torch.all(model.layers[1].moe.router.expert_bias == 0)
    assert model.layers[1].moe.router.expert_bias.dtype == torch.float32
    wq, wo = model.layers[3].attention.wq.weight.float(), model.layers[3].attention.wo.weight.float()
    assert abs(wq.std().item() - 0.02) < 0.002
    assert abs(wo.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.001  # depth-scaled: layer 3
    assert wq.abs().max() <= 3 * 0.02 + 1e-3  # truncated at 3 std


def test_training_30_adamw_steps_reduce_loss():
    torch.manual_seed(0)
    model = build_model("debug")
    tokens = _tokens(2, 17, seed=1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------- MoE semantics


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's per-expert loop (inference/model.py MoE.forward), from the same weights."""
    flat = x.reshape(-1, x.shape[-1])
    weights, ids = moe.router(flat)
    out = torch.zeros_like(flat, dtype=torch.float32)
    for e in range(moe.n_experts):
        tok, slot = torch.where(ids == e)
        w1, w2, w3 = moe.experts.w1[e], moe.experts.w2[e], moe.experts.w3[e]
        h = F.silu(flat[tok] @ w1.T) * (flat[tok] @ w3.T)
        out.index_add_(0, tok, (h @ w2.T).float() * weights[tok, slot, None])
    return (out.to(x.dtype) + moe.shared_experts(flat)).view(x.shape)


def test_moe_grouped_path_matches_per_expert_loop():
    torch.manual_seed(0)
    moe = MoE(get_config("debug", dtype=torch.float32))
    for block in (moe.router.gate, moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3):
        nn.init.normal_(block.weight, std=0.05)
    for w in (moe.experts.w1, moe.experts.w2, moe.experts.w3):
        nn.init.normal_(w, std=0.05)
    x = torch.randn(2, 24, 256)
    assert_close(moe(x), _reference_moe(moe, x), rtol=1e-5, atol=1e-5)


def _router_with_logits(logits: list[float], **overrides) -> tuple[TopKRouter, torch.Tensor]:
    """A debug router whose gate maps the one-hot input x to exactly these expert logits."""
    router = TopKRouter(get_config("debug", dtype=torch.float32, **overrides))
    with torch.no_grad():
        router.gate.weight.zero_()
        router.gate.weight[:, 0] = torch.tensor(logits)
    x = torch.zeros(1, 256)
    x[0, 0] = 1.0
    return router, x


# groups are experts [0..3] and [4..7]; one group kept
GROUP_LOGITS = [3.0, 0.5, 0.0, 0.0, 2.5, 2.4, 0.0, 0.0]


def test_sigmoid_router_keeps_group_with_best_top2_sum():
    router, x = _router_with_logits(GROUP_LOGITS)
    _, ids = router(x)
    # best single expert is 0, but group 1's top-2 sum (0.92 + 0.92) beats group 0's (0.95 + 0.62)
    assert sorted(ids[0].tolist()) == [4, 5]
    unlimited, _ = _router_with_logits(GROUP_LOGITS, n_expert_groups=1, n_limited_groups=1)
    assert sorted(unlimited(x)[1][0].tolist()) == [0, 4]


def test_softmax_router_keeps_group_with_best_max():
    router, x = _router_with_logits(GROUP_LOGITS, score_func="softmax", route_norm=False, route_scale=1.0)
    weights, ids = router(x)
    assert sorted(ids[0].tolist()) == [0, 1]  # group 0 holds the max score
    probs = torch.tensor(GROUP_LOGITS).softmax(-1)
    assert_close(weights[0].sort().values, probs[[1, 0]])  # softmax weights are not renormalized


def test_group_limited_topk_picks_only_within_kept_groups():
    torch.manual_seed(0)
    router = TopKRouter(get_config("debug", n_expert_groups=4, n_limited_groups=2, n_activated_experts=3))
    nn.init.normal_(router.gate.weight, std=0.5)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    _, ids = router(x)
    scores = torch.sigmoid(router.gate(x).float()).view(64, 4, 2)
    kept = scores.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [T, 2] groups
    for t in range(64):
        assert set((ids[t] // 2).tolist()) <= set(kept[t].tolist())


def test_expert_bias_changes_selection_but_not_weights():
    router, x = _router_with_logits(GROUP_LOGITS)
    scores = torch.sigmoid(torch.tensor(GROUP_LOGITS))
    weights, ids = router(x)
    assert sorted(ids[0].tolist()) == [4, 5]
    with torch.no_grad():
        router.expert_bias[[2, 3]] = 1.0  # pushes group 0 and its experts 2, 3 to the top
    biased_weights, biased_ids = router(x)
    assert sorted(biased_ids[0].tolist()) == [2, 3]
    # weights come from the unbiased scores, renormalized (sigmoid) and scaled by 2.5
    picked = scores[biased_ids[0]]
    assert_close(biased_weights[0], 2.5 * picked / picked.sum())
    with torch.no_grad():
        router.expert_bias.fill_(0.3)  # a uniform shift changes nothing at all
    assert_close(router(x)[0], weights, rtol=0, atol=0)
    assert torch.equal(router(x)[1], ids)


# ---------------------------------------------------------------- RoPE / YaRN


def test_rope_matches_deepseek_complex_form_and_yarn_scales_slow_pairs():
    config = get_config("debug")
    inv_freq = yarn_inv_freq(config)
    plain = 1.0 / (config.rope_theta ** (torch.arange(0, 32, 2).float() / 32))
    assert_close(inv_freq[0], plain[0])  # fastest pair is extrapolated (kept)
    assert_close(inv_freq[-1], plain[-1] / config.rope_factor)  # slowest pair is interpolated
    rope = RotaryEmbedding(config)
    cos, sin = rope(16)
    x = torch.randn(2, 16, 4, 32)
    # DeepSeek: view_as_complex over consecutive pairs times polar(1, pos * inv_freq)
    freqs_cis = torch.polar(torch.ones(16, 16), torch.outer(torch.arange(16).float(), inv_freq))
    expected = torch.view_as_real(torch.view_as_complex(x.view(2, 16, 4, 16, 2)) * freqs_cis[None, :, None]).flatten(3)
    assert_close(apply_rotary_emb(x, cos, sin), expected, rtol=1e-5, atol=1e-5)
    assert not [name for name, _ in rope.named_buffers() if name in rope.state_dict()]  # non-persistent


def test_softmax_scale_includes_yarn_mscale():
    config = get_config("debug")
    assert yarn_softmax_scale(config) == pytest.approx(64**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2)
    assert yarn_softmax_scale(get_config("debug", max_seq_len=4096)) == pytest.approx(64**-0.5)


# ---------------------------------------------------------------- torch.compile


def _capture_graphs(module, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend, fullgraph=True)(*args)
    return graphs


def _call_targets(gm) -> Counter:
    return Counter(
        getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op in ("call_function", "call_method")
    )


def test_blocks_trace_as_one_graph_without_breaks():
    torch.manual_seed(0)
    model = build_model("debug")
    cos, sin = model.rope(16)
    x = torch.randn(2, 16, 256, dtype=torch.bfloat16)

    moe_graphs = _capture_graphs(model.layers[1], x, cos, sin)
    assert len(moe_graphs) == 1
    targets = _call_targets(moe_graphs[0])
    assert targets["_grouped_mm"] == 3
    assert targets["linear"] == 8  # wq, wkv_a, wkv_b, wo, router gate, 3 shared-expert linears
    assert targets["argsort"] == 1 and targets["index_add"] == 1

    dense_graphs = _capture_graphs(model.layers[0], x, cos, sin)
    assert len(dense_graphs) == 1
    assert _call_targets(dense_graphs[0])["linear"] == 7 and "_grouped_mm" not in _call_targets(dense_graphs[0])

    explanation = torch._dynamo.explain(model)(_tokens(2, 16))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_inductor_compiled_logits_match_eager():
    torch.manual_seed(0)
    model = build_model("debug", n_layers=2)  # one dense and one MoE block: Inductor-CPU compile time is the cost
    tokens = _tokens(2, 32)
    eager = model(tokens)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor", fullgraph=True)(tokens)
    assert compiled.shape == eager.shape and compiled.dtype == torch.bfloat16
    # bf16: about one ulp of |logits| <= ~4
    assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=6e-2)
    assert (compiled.float() - eager.float()).abs().mean() < 1e-2
