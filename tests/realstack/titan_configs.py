"""torchtitan config functions for its trainer's `--module realstack.titan_configs --config <name>`.

torchtitan's ConfigManager imports `--module` (a dotted path) and calls `--config` with no arguments; the CLI
then overrides any field but the model, whose spec the CLI cannot reach (`tyro.conf.Suppress`). So the changes
to the model live here:
- attention: torchtitan's DeepSeek-V3 configs all use FlexAttention, and torchtitan's apply_compile refuses a
  compile backend other than "inductor"/"aot_eager" for a FlexAttention model; each layer's inner attention
  becomes torchtitan's own `ScaledDotProductAttention` (causal; unlike Flex's block-causal mask it lets a token
  attend across a document boundary inside a packed sequence);
- size (the `_tiny` configs only): torchtitan's debugmodel takes about a minute a step with moepass's emulated
  MXFP8 on 2 CPU cores, so these build the same model, by torchtitan's own DeepSeek-V3 layer builder, at small
  dims (every GEMM's K and N still a multiple of 32, MXFP8's block).
Everything else (optimizer, LR schedule, loss, selective AC, tokenizer vocabulary) is torchtitan's
deepseek_v3_debugmodel config as shipped.
"""

from __future__ import annotations

import dataclasses


def with_sdpa_attention(config):
    """`config` (a torchtitan Trainer.Config) with every attention layer's inner attention SDPA, causal."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    model = config.model_spec.model
    for layer in [*model.layers, *model.mtp_layers]:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def tiny_debugmodel(n_layers: int = 2, dim: int = 128):
    """torchtitan's DeepSeek-V3 debugmodel (first layer dense, the rest MoE: 8 experts, top-3 softmax routing,
    2 shared experts, MLA without q LoRA, YaRN RoPE, vocabulary 2048) at small dims."""
    from torchtitan.models import deepseek_v3 as dsv3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    vocab_size, head_dim = 2048, 32
    layers = dsv3._build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=2, q_lora_rank=0, kv_lora_rank=64,
        qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim, v_head_dim=head_dim, mscale=0.70,
        dense_hidden_dim=2 * dim, moe_hidden_dim=dim // 2, num_experts=8, num_shared_experts=2, router_top_k=3,
        router_score_func="softmax", attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=4096 * 4, theta=10000.0, scaling="yarn",
                                rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=4096),
    )
    return dsv3.DeepSeekV3Model.Config(
        vocab_size=vocab_size, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=dsv3._output_linear_init(dim)),
        layers=layers, mtp_layers=[],
    )


def sdpa_debugmodel(n_layers: int = 2):
    """tiny_debugmodel built in BF16 on CPU with SDPA attention (not flex), its buffers initialised: the model the
    pass tests compile directly, without torchtitan's trainer."""
    import torch
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.tools.utils import set_default_dtype

    config = tiny_debugmodel(n_layers=n_layers)
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("cpu"), set_default_dtype(torch.bfloat16):
        model = config.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    return model


def _debugmodel_config(model=None):
    """torchtitan's deepseek_v3_debugmodel trainer config, its model replaced by `model` when given."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    if model is not None:
        config.model_spec = dataclasses.replace(config.model_spec, flavor="debugmodel_tiny", model=model)
    return config


def deepseek_v3_debugmodel_sdpa():
    """torchtitan's deepseek_v3_debugmodel as shipped (6 layers, dim 256, 16 heads), SDPA attention."""
    return with_sdpa_attention(_debugmodel_config())


def deepseek_v3_debugmodel_tiny_sdpa():
    """The debugmodel at dim 128, 2 layers (1 dense, 1 MoE), 2 heads of 32+32: SDPA attention."""
    return with_sdpa_attention(_debugmodel_config(tiny_debugmodel(n_layers=2)))


def deepseek_v3_debugmodel_tiny4_sdpa():
    """As deepseek_v3_debugmodel_tiny_sdpa with 4 layers (1 dense, 3 MoE): enough for 2 pipeline stages."""
    return with_sdpa_attention(_debugmodel_config(tiny_debugmodel(n_layers=4)))


def deepseek_v3_debugmodel_tiny():
    """deepseek_v3_debugmodel_tiny_sdpa with torchtitan's FlexAttention kept (for `--compile.backend inductor`)."""
    return _debugmodel_config(tiny_debugmodel(n_layers=2))
