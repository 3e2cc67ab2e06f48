"""torchtitan 0.3.0's own DeepSeek-V3 MoE, expert-parallel over gloo CPU ranks, parallelized by torchtitan.

Every function here runs inside an already-initialised process group (2 gloo ranks on 127.0.0.1).
The model is torchtitan's `DeepSeekV3Model` (MLA + MoE blocks) at tiny dims, built from torchtitan's
own config builders and parallelized by torchtitan's own code, unmodified:

    cfg.update_from_config(config=<obj with .parallelism>)   # -> set_deepseek_v3_sharding_config
                                                              #    -> set_moe_sharding_config(enable_ep=True)
    ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=2, world_size=2)
    model.parallelize(parallel_dims)                          # what parallelize_deepseekv3 does first
    <AC>.Config().build().apply(model)                        # FullAC / SelectiveAC ("op" SAC)
    parallelize_deepseekv3(...)                               # FSDP2 variant: the whole torchtitan path

Departures, all configuration or public API, none in torchtitan's code: its mesh device type is
pointed at "cpu" (`torchtitan.distributed.parallel_dims.device_type`, "cuda" on a machine with no
accelerator); the inner attention is torchtitan's `ScaledDotProductAttention` (causal) instead of
FlexAttention (Varlen needs CUDA; Flex makes `apply_compile` refuse backends other than
"inductor"/"aot_eager"); the model is initialised whole before `parallelize` (the trainer inits
after, on meta) so every rank holds the same seed-determined weights; the FSDP2 variant runs under
spmd_backend="partial_dtensor" with FSDP's gradient reduce forced to SUM, both for torch 2.13 + gloo.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROUTING = {  # each flavor's router, shrunk to 8 experts (671B: 8 of 256, 8 groups, 4 kept)
    "16B-like": dict(router_top_k=3, router_score_func="softmax", num_shared_experts=2),
    "671B-like": dict(router_top_k=3, router_score_func="sigmoid", router_num_expert_groups=4,
                      router_num_limited_groups=2, router_route_norm=True, router_route_scale=2.5,
                      num_shared_experts=1),
}
FLAVORS = tuple(ROUTING)
AC_KINDS = ("none", "full", "selective")
EP_DEGREE = 2


def point_torchtitan_at_cpu() -> None:
    """torchtitan builds its DeviceMesh on `device_type`, "cuda" when no accelerator is present."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    parallel_dims_module.device_type = "cpu"


def model_config(flavor: str, *, dim: int = 64, moe_hidden_dim: int = 64, num_experts: int = 8,
                 n_layers: int = 1, n_dense_layers: int = 0, vocab_size: int = 128, max_seq_len: int = 64,
                 force_load_balance: bool = False, spmd_backend: str = "spmd_types", head_dim: int = 16,
                 top_k: int | None = None, parallelism: dict | None = None):
    """A tiny DeepSeekV3Model.Config from torchtitan's own layer builder, its sharding set by torchtitan for
    `parallelism` (ParallelismConfig fields; default EP=2). head_dim sets the MLA nope, rope and value head dims;
    top_k overrides the flavor's (top_k = num_experts: no rounding difference can flip a token's experts)."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models import deepseek_v3 as dsv3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if flavor not in ROUTING:
        raise ValueError(f"flavor {flavor!r}: expected one of {FLAVORS}")
    rope_dim = head_dim
    layers = dsv3._build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=n_dense_layers, dim=dim, n_heads=2, q_lora_rank=0,
        kv_lora_rank=32, qk_nope_head_dim=head_dim, qk_rope_head_dim=rope_dim, v_head_dim=head_dim, mscale=0.70,
        dense_hidden_dim=2 * dim, moe_hidden_dim=moe_hidden_dim, num_experts=num_experts,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=max_seq_len, theta=10000.0, scaling="yarn",
                                rope_factor=40.0, beta_fast=32.0, beta_slow=1.0, original_seq_len=max_seq_len),
        **{**ROUTING[flavor], **({"router_top_k": top_k} if top_k else {})},
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        if layer.moe is not None:  # torchtitan's debug.moe_force_load_balance: round-robin experts
            layer.moe.router._debug_force_load_balance = force_load_balance
    cfg = dsv3.DeepSeekV3Model.Config(
        vocab_size=vocab_size, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init=dsv3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=dsv3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=dsv3._output_linear_init(dim)),
        layers=layers, mtp_layers=[],
    )
    parallelism = ParallelismConfig(**{"expert_parallel_degree": EP_DEGREE, "spmd_backend": spmd_backend,
                                       **(parallelism or {})})
    cfg.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return cfg, parallelism


def ac_config(ac: str):
    """torchtitan's own activation-checkpointing config for `ac` (SelectiveAC is its per-op SAC)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    configs = {"none": None, "full": FullAC.Config, "selective": SelectiveAC.Config}
    if ac not in configs:
        raise ValueError(f"ac {ac!r}: expected one of {AC_KINDS}")
    return configs[ac]() if configs[ac] is not None else None


@dataclass
class TitanEP:
    """A torchtitan model parallelized on this rank, and the SPMD context its forward runs in."""

    model: torch.nn.Module
    parallel_dims: Any
    flavor: str
    ac: str
    fsdp: bool
    seq_len: int
    vocab_size: int

    def context(self) -> contextlib.AbstractContextManager:
        """The trainer's train_context: registers the dense/sparse SPMD meshes under spmd_types."""
        from torchtitan.distributed.utils import get_spmd_context

        return get_spmd_context(parallel_dims=self.parallel_dims)()

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return list(self.model.layers.values())


def _build(flavor: str, *, seed: int, dtype: torch.dtype, spmd_backend: str, seq_len: int, sizes: dict):
    """The model built whole on this rank (not parallelized yet), its ParallelDims with meshes, its config."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.tools.utils import set_default_dtype

    point_torchtitan_at_cpu()
    set_spmd_backend(spmd_backend)
    cfg, parallelism = model_config(flavor, spmd_backend=spmd_backend, max_seq_len=max(64, seq_len), **sizes)
    parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
    parallel_dims.build_mesh()
    # Initialised whole on every rank before sharding, so weights depend on the seed only.
    torch.manual_seed(seed)
    with torch.device("cpu"), set_default_dtype(dtype):
        model = cfg.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    model.train()
    return model, parallel_dims, parallelism


def build_moe(flavor: str, *, seed: int = 0, ac: str = "none", spmd_backend: str = "spmd_types",
              dtype: torch.dtype = torch.bfloat16, seq_len: int = 16, **sizes) -> TitanEP:
    """EP=2 without FSDP, experts sharded 4+4; bf16 weights is torchtitan's training.dtype="bfloat16".

    `sizes` go to `model_config` (dim, moe_hidden_dim, num_experts, n_layers, vocab_size,
    force_load_balance). On CPU torchtitan's fp32 autocast around the router gate is a no-op, so a
    bf16 router's near-ties flip routing between eager and Inductor (expert grads then differ by
    10-40%); compare those with force_load_balance=True or dtype=torch.float32 (<1%).
    """
    model, parallel_dims, _ = _build(flavor, seed=seed, dtype=dtype, spmd_backend=spmd_backend,
                                     seq_len=seq_len, sizes=sizes)
    model.parallelize(parallel_dims)
    policy = ac_config(ac)
    if policy is not None:
        policy.build(dump_folder="").apply(model)
    return TitanEP(model, parallel_dims, flavor, ac, False, seq_len, model.config.vocab_size)


def build_parallel(flavor: str, *, tp: int = 1, ep: int = 1, sp: bool = True, fsdp: bool = False, ac: str = "none",
                   seed: int = 0, spmd_backend: str = "partial_dtensor", seq_len: int = 16,
                   dtype: torch.dtype | None = None, **sizes) -> TitanEP:
    """torchtitan's own parallelization at any of its degrees: TP (torchtitan's colwise/rowwise plans, sequence
    parallel when `sp`), EP, FSDP2 over the ranks left (`fsdp`: torchtitan's whole parallelize_deepseekv3, fp32
    master weights and bf16 compute), and AC. tp=ep=1 without fsdp is the same model unsharded on every rank.

    spmd_backend "partial_dtensor" puts DTensors in the graphs (parallelize_module's layouts); torchtitan's default
    "spmd_types" runs TP on plain local tensors with explicit collectives."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3

    degrees = {"tensor_parallel_degree": tp, "expert_parallel_degree": ep, "enable_sequence_parallel": sp}
    if not fsdp:
        degrees["data_parallel_shard_degree"] = dist.get_world_size() // tp if tp > 1 or ep > 1 else -1
    dtype = dtype or (torch.float32 if fsdp else torch.bfloat16)  # FSDP2: fp32 master weights, bf16 compute
    model, parallel_dims, parallelism = _build(flavor, seed=seed, dtype=dtype,
                                               spmd_backend=spmd_backend, seq_len=seq_len,
                                               sizes=dict(sizes, parallelism=degrees))
    if fsdp:
        model = parallelize_deepseekv3(
            model, parallel_dims=parallel_dims, training=TrainingConfig(), parallelism=parallelism,
            compile_config=CompileConfig(enable=False), ac_config=ac_config(ac), dump_folder="")
        allow_gloo_reduce_scatter(model)
    else:
        if tp > 1 or ep > 1:
            model.parallelize(parallel_dims)
        policy = ac_config(ac)
        if policy is not None:
            policy.build(dump_folder="").apply(model)
    return TitanEP(model, parallel_dims, flavor, ac, fsdp, seq_len, model.config.vocab_size)


def fsdp_per_block(flavor: str, *, seed: int = 0, ac: str = "none", spmd_backend: str = "partial_dtensor",
                   seq_len: int = 16, n_layers: int = 2, **sizes) -> TitanEP:
    """torchtitan's whole parallelize_deepseekv3: EP, AC, FSDP2 per block (fp32 master, bf16 params).

    spmd_backend defaults to "partial_dtensor": under torchtitan's default "spmd_types" the
    parameters stay plain tensors and torch 2.13's fully_shard(dp_mesh_dims=...) rejects them
    ("When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh").
    Compilation is left to `compile_blocks` (torchtitan compiles before fully_shard; Module.compile
    wraps `_call_impl`, which runs the FSDP hooks registered later, so the order does not matter).
    """
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3

    model, parallel_dims, parallelism = _build(flavor, seed=seed, dtype=torch.float32, spmd_backend=spmd_backend,
                                               seq_len=seq_len, sizes=dict(sizes, n_layers=n_layers))
    model = parallelize_deepseekv3(
        model, parallel_dims=parallel_dims, training=TrainingConfig(), parallelism=parallelism,
        compile_config=CompileConfig(enable=False), ac_config=ac_config(ac), dump_folder="")
    allow_gloo_reduce_scatter(model)
    return TitanEP(model, parallel_dims, flavor, ac, True, seq_len, model.config.vocab_size)


def allow_gloo_reduce_scatter(model: torch.nn.Module) -> None:
    """FSDP2 gradient reduction as SUM then x1.0: torchtitan's divide factor 1.0 asks for PREMUL_SUM(1.0),
    which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); same numbers."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def compile_blocks(titan: TitanEP, backend: str | Callable, options: dict | None = None) -> None:
    """torchtitan's apply_compile, with `options` forwarded (apply_compile takes a backend name only)."""
    # process-wide, as torchtitan's own apply_compile sets them (torchtitan/distributed/compile.py)
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    kwargs = {"options": options} if options is not None else {}
    for block in titan.blocks:
        block.compile(backend=backend, fullgraph=True, **kwargs)


def data_rank(titan: TitanEP) -> int:
    """This rank's data-parallel index: ranks of one tensor-parallel group (torchtitan's innermost mesh dim) see the
    same batch."""
    return dist.get_rank() // titan.parallel_dims.tp


def example_batch(titan: TitanEP, *, seed: int = 1, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels that differ per data-parallel rank."""
    generator = torch.Generator().manual_seed(seed * 1000 + data_rank(titan))
    tokens = torch.randint(0, titan.vocab_size, (batch, titan.seq_len), generator=generator)
    labels = torch.randint(0, titan.vocab_size, (batch, titan.seq_len), generator=generator)
    return tokens, labels


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _plain_name(name: str) -> str:
    """Parameter names without AC/compile wrapper segments, equal across variants."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


@dataclass
class StepResult:
    output: torch.Tensor
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]


def forward_backward(titan: TitanEP, tokens: torch.Tensor, labels: torch.Tensor) -> StepResult:
    """One forward + backward; logits, loss and this rank's local gradient of every parameter."""
    titan.model.zero_grad(set_to_none=True)
    with titan.context():
        logits = titan.model(tokens)
        loss = F.cross_entropy(_local(logits).flatten(0, 1).float(), labels.flatten())
        loss.backward()
    grads = {_plain_name(n): _local(p.grad).detach().float().clone()
             for n, p in titan.model.named_parameters() if p.grad is not None}
    return StepResult(_local(logits).detach().float().clone(), loss.detach().clone(), grads)


class _GatherShards(torch.autograd.Function):
    """All-gather a tensor-parallel shard along `dim`; the gradient is this rank's slice (every rank of the group
    computes the same loss from the whole, so summing the ranks' gradients, as all_gather's backward does, would
    count it tp times)."""

    @staticmethod
    def forward(ctx, t, dim, group):
        ctx.dim, ctx.rank, ctx.size = dim, dist.get_rank(group), t.shape[dim]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(ctx.dim, ctx.rank * ctx.size, ctx.size), None, None


def _gathered(t: torch.Tensor, full_shape: torch.Size, group) -> torch.Tensor:
    """A tensor-parallel shard (a DTensor, or under spmd_types a plain local tensor) as the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    if t.shape == full_shape:
        return t
    (dim,) = [d for d, (a, b) in enumerate(zip(t.shape, full_shape)) if a != b]  # the one dim TP split
    return _GatherShards.apply(t, dim, group)


def full_step(titan: TitanEP, tokens: torch.Tensor, labels: torch.Tensor, param_shapes: dict) -> StepResult:
    """forward_backward with every sharded value made whole: logits (vocab-parallel under TP), and each
    parameter's gradient shaped as in `param_shapes` (the unsharded model's)."""
    group = titan.parallel_dims.get_mesh("tp").get_group() if titan.parallel_dims.tp_enabled else None
    titan.model.zero_grad(set_to_none=True)
    with titan.context():
        logits = titan.model(tokens)
        if group is not None:
            logits = _gathered(logits, (*logits.shape[:-1], titan.vocab_size), group)
        logits = _local(logits)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    grads = {}
    for name, p in titan.model.named_parameters():
        if p.grad is not None:
            name = _plain_name(name)
            grad = _gathered(p.grad, param_shapes[name], group).detach().float().clone()
            if group is not None and type(p.grad) is torch.Tensor and p.grad.shape == param_shapes[name]:
                # spmd_types leaves a replicated weight's gradient as each rank's partial sum (its own tokens)
                dist.all_reduce(grad, group=group)
            grads[name] = grad
    return StepResult(logits.detach().float().clone(), loss.detach().clone(), grads)


def train_steps(titan: TitanEP, backend: str | Callable | None, options: dict | None = None, *,
                steps: int = 2, lr: float = 1e-2, seed: int = 1) -> list[StepResult]:
    """Compile each block with `backend`, then `steps` SGD steps on fresh batches.

    backend=None runs eagerly, which works under "partial_dtensor" only: eager "spmd_types" sends
    tokens with dist.all_to_all (lists), which gloo refuses for uneven splits. Compiled, both
    backends use _functional_collectives.all_to_all_single. "aot_eager" is the reference that
    also runs AC graphs ("eager" re-runs a checkpoint HOP whose input the body mutates in place).
    """
    if backend is not None:
        compile_blocks(titan, backend, options)
    optimizer = torch.optim.SGD(titan.model.parameters(), lr=lr)
    results = []
    for step in range(steps):
        tokens, labels = example_batch(titan, seed=seed + step)
        results.append(forward_backward(titan, tokens, labels))
        optimizer.step()
    return results


__all__ = ["FLAVORS", "AC_KINDS", "TitanEP", "StepResult", "build_moe", "build_parallel", "fsdp_per_block",
           "compile_blocks", "example_batch", "forward_backward", "full_step", "train_steps", "model_config", "ac_config",
           "point_torchtitan_at_cpu", "allow_gloo_reduce_scatter"]
