"""moepass/inductor_route.py and moepass/torchtitan.py: moepass inside `backend="inductor"`.

torchtitan 0.3.0 refuses every backend but "inductor"/"aot_eager" for a FlexAttention model, so the route runs
moepass's pipeline as Inductor's pre-grad custom pass. Checked on CPU:
- a FlexAttention model of our own, compiled per block with backend="inductor": its linears and grouped GEMMs
  are rewritten (report, Dynamo graph, compiled graph) and flex_attention stays for Inductor to lower;
- a training step of moepass's debug DeepSeek-V3 (SDPA) under activation checkpointing through the route equals
  one through backend="moepass": same rewrites (inside the checkpointed body), the recompute and the quantized
  backward GEMMs in the backward graph, bit-equal loss and gradients;
- the FP8-rowwise decompositions reach Inductor (aten._scaled_mm in the compiled graphs, no opaque op);
- a warm compile cache still reports every rewrite (torch >= 2.12: the pipeline runs before the cache lookup);
- torchtitan's own DeepSeek-V3 debugmodel config, as shipped (flex), parsed from the command line a user types
  (`--override.imports moepass.torchtitan.moepass=...`), compiled by torchtitan's apply_compile: rewritten;
- torchtitan's expert-parallel MoE (2 gloo ranks, its selective AC; pytest -m extended): the EP region becomes
  DeepEP dispatch/combine and the backward sends nothing again;
- not installed, or installed then removed, a plain Inductor compile is untouched.
FlexAttention has no CPU backward: the flex training step is the GPU test at the end (route vs backend on CUDA;
on an H200 with torch 2.11 the FP8-rowwise decompositions show as aten._scaled_mm / _scaled_grouped_mm).
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moepass
from moepass import inductor_route
from moepass.inductor_stage.cache_key import CompiledGraphAudit
from moepass.harness.train import next_token_loss
from moepass.models import build_model
from moepass.recipes.registry import RECIPES, settle
from helpers import compile_caches_off, rank_pool, scaled_mm_on_cpu  # noqa: F401  (fixtures)

BF16 = torch.bfloat16
TORCH = tuple(int(v) for v in torch.__version__.split(".")[:2])
needs_torchtitan = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None or TORCH < (2, 12),
                                      reason="torchtitan 0.3.0 (the [test] extra) needs torch >= 2.12")


@contextlib.contextmanager
def vectorized_cpu_code():
    """Inductor's CPU FlexAttention template needs SIMD code, which tests/conftest.py turns off for compile time: on
    around the flex blocks' compiles only (g++ takes longer over SIMD code). Inductor caches its answer per process
    (functools.cache on the ISA probes): forgotten on the way in and out."""
    try:
        with torch._inductor.config.patch({"cpp.vec_isa_ok": None}):  # None: Inductor probes the CPU
            _forget_vec_isa()
            yield
    finally:
        _forget_vec_isa()


def _forget_vec_isa():
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    classes = [cpu_vec_isa.VecISA]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        for attr in vars(cls).values():
            if hasattr(attr, "cache_clear"):
                attr.cache_clear()


@pytest.fixture(autouse=True)
def fresh_route():
    """Every test starts and ends with the route removed and Dynamo's caches empty."""
    inductor_route.uninstall()
    torch._dynamo.reset()
    yield
    inductor_route.uninstall()
    torch._dynamo.reset()


def pass_totals(report) -> dict[str, int]:
    return {p["name"]: p["replaced"] for p in report.to_dict()["passes"]}


def compiled_ops(report, kind: str) -> dict[str, int]:
    """Op counts summed over the post-grad graphs of one kind Inductor compiled for the report."""
    total: dict[str, int] = {}
    for c in report.compiled:
        if c["kind"] == kind:
            for op, n in c["ops"].items():
                total[op] = total.get(op, 0) + n
    return total


# ---- a FlexAttention MoE of our own ---------------------------------------------------------------

class FlexMoEBlock(nn.Module):
    """Attention through flex_attention between four linears, then experts as two grouped GEMMs over fixed token
    groups (what an MoE layer runs after sorting tokens by expert)."""

    def __init__(self, dim: int = 64, heads: int = 2, hidden: int = 64, experts: int = 4):
        super().__init__()
        self.heads, self.experts = heads, experts
        # q, k and v apart: torch 2.11's CPU flex lowering refuses q, k, v that are views of one buffer
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x: torch.Tensor, block_mask) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        b, s, d = x.shape
        # contiguous: Inductor's CPU flex template reads the shape of its inputs' buffers, not of views of them
        q, k, v = (proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2).contiguous()
                   for proj in (self.q, self.k, self.v))
        x = x + self.out(flex_attention(q, k, v, block_mask=block_mask).transpose(1, 2).reshape(b, s, d))
        tokens = x.reshape(b * s, d)
        group = b * s // self.experts
        offs = torch.arange(group, b * s + 1, group, dtype=torch.int32, device=x.device)
        h = F.silu(torch._grouped_mm(tokens, self.w1, offs=offs))
        return x + torch._grouped_mm(h, self.w2, offs=offs).view(b, s, d)


class FlexMoE(nn.Module):
    def __init__(self, n_blocks: int = 2, **dims):
        super().__init__()
        self.blocks = nn.ModuleList(FlexMoEBlock(**dims) for _ in range(n_blocks))

    def forward(self, x, block_mask):
        for block in self.blocks:
            x = block(x, block_mask)
        return x


def causal_mask(seq: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seq, seq, device=device)


def compile_per_block(model: nn.Module, blocks, backend: str, options: dict | None = None) -> None:
    """As torchtitan's apply_compile does: each block on its own, whole graph."""
    kwargs = {"options": options} if options else {}
    for block in blocks:
        block.compile(backend=backend, fullgraph=True, **kwargs)


# ~28 s on 2 cores with a cold cache; in CI the torchtitan debugmodel test below checks the same route (flex left for
# Inductor, every linear and grouped GEMM rewritten, the ops reaching Inductor's graph) on the shipped model
@pytest.mark.extended
def test_flex_blocks_compiled_by_inductor_are_rewritten():
    torch.manual_seed(0)
    model = FlexMoE().to(BF16)
    x = torch.randn(2, 64, 64, dtype=BF16)
    mask = causal_mask(64, "cpu")
    with torch.no_grad():
        want = model(x, mask)  # eager BF16
    inductor_route.install()
    compile_per_block(model, model.blocks, "inductor")
    with moepass.collecting() as report, compile_caches_off(), torch.no_grad(), vectorized_cpu_code():
        got = model(x, mask)

    assert report.graphs, "the route saw no graph"
    for graph in report.graphs:  # blocks of one shape may share a graph: counts are per graph
        assert graph.ops_after["flex_attention"] == 1  # left for Inductor to lower
        assert graph.ops_after["moepass.mxfp8_linear"] == 4 and "linear" not in graph.ops_after
        assert graph.ops_after["moepass.mxfp8_grouped_mm"] == 2 and "_grouped_mm" not in graph.ops_after
    totals = pass_totals(report)
    assert totals["linear"] == 4 * len(report.graphs) and totals["grouped_mm"] == 2 * len(report.graphs)
    forward = compiled_ops(report, "forward")  # the rewritten ops reached Inductor's post-grad graph
    assert forward.get("moepass.mxfp8_linear") == totals["linear"], report.compiled
    assert forward.get("moepass.mxfp8_grouped_mm") == totals["grouped_mm"], report.compiled
    assert got.shape == want.shape and got.isfinite().all()
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert 0 < err < 0.1, f"MXFP8 vs BF16 relative error {err:.3g}"  # quantized, and close


# ---- a training step, route vs backend --------------------------------------------------------------

def _debug_train_step(backend: str, options: dict | None = None):
    """One AdamW step of the debug model's MoE block under activation checkpointing (what torchtitan's shipped
    configs do), compiled per block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = build_model("debug", n_layers=1, n_dense_layers=0)  # one MoE block; SDPA attention
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compile_per_block(model, model.layers, backend, options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with moepass.collecting() as report, compile_caches_off():
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    return loss.detach(), grads, moved, report


@pytest.mark.extended  # ~45 s; CI runs the route on torchtitan's flex model and on per-block compiles
def test_checkpointed_training_step_through_the_route_equals_the_backend():
    options = {"passes": ["grouped_mm", "linear"]}
    inductor_route.install(options)
    loss, grads, moved, report = _debug_train_step("inductor")
    inductor_route.uninstall()
    torch._dynamo.reset()
    want_loss, want_grads, _, want_report = _debug_train_step("moepass", options)

    totals = pass_totals(report)
    assert totals == pass_totals(want_report) and totals["grouped_mm"] == 3 and totals["linear"] > 0, totals
    rewrites = [r for p in report.to_dict()["passes"] for r in p["rewrites"]]
    assert all(r["node"].startswith("wrap_body") for r in rewrites), rewrites  # inside the checkpointed body
    backward = compiled_ops(report, "backward")  # the recompute and the quantized dgrad/wgrad GEMMs
    assert backward == compiled_ops(want_report, "backward")
    assert backward.get("moepass.mxfp8_grouped_mm") == backward.get("moepass.mxfp8_grouped_mm_dgrad") == 3, backward
    assert backward.get("moepass.mxfp8_linear_wgrad") == totals["linear"], backward
    # the step moved every weight but the RMSNorm scales (1.0 in BF16: an AdamW step of 1e-3 is below its ulp)
    assert loss.isfinite() and set(grads) - set(moved) == {n for n in grads if n.endswith("norm.weight")}
    assert torch.equal(loss, want_loss)  # the same rewritten graph through the same compiler
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name


@pytest.mark.skipif(TORCH < (2, 12), reason="torch 2.11's CPU _scaled_mm takes per-tensor scales only (the GPU "
                    "test checks the decompositions there)")
def test_fp8_rowwise_decompositions_reach_inductor(scaled_mm_on_cpu):
    options = {"recipe": "fp8_rowwise", "fp8_rowwise.kernel": "scaled_mm", "lowp.keep_output_head_bf16": False}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 32, bias=False)).to(BF16)
    x = torch.randn(2, 24, 64, dtype=BF16)
    with inductor_route.route(options), moepass.collecting() as report, compile_caches_off():
        torch.compile(model, backend="inductor")(x).float().square().sum().backward()
    assert pass_totals(report)["linear"] == 2
    forward, backward = compiled_ops(report, "forward"), compiled_ops(report, "backward")
    # backward: both wgrads and the second linear's dgrad (x needs no gradient)
    assert forward.get("aten._scaled_mm") == 2 and backward.get("aten._scaled_mm") == 3, (forward, backward)
    # only the kernel that writes an operand's two layouts at once (fp8_rowwise.linear_both_layouts=auto) stays opaque
    assert not [op for op in (*forward, *backward) if op.startswith("moepass.")
                and op != "moepass.fp8_rowwise_rows_and_cols"], (forward, backward)


def test_decompositions_installed_after_an_earlier_compile_reach_inductor():
    """Inductor reads its default table through a copy it caches on first use: an installation after an earlier
    compile in the process (another test, a BF16 warm-up) must still be seen, and an uninstalled one must not."""
    from torch._inductor.decomposition import select_decomp_table

    import moepass.ops  # noqa: F401  (registers the op the decomposition is keyed on)

    op = torch.ops.moepass.fp8_rowwise_linear.default
    select_decomp_table()  # what any earlier Inductor compile did
    with inductor_route.route({"recipe": "fp8_rowwise"}):
        assert op in select_decomp_table()
    assert op not in select_decomp_table()


@pytest.mark.skipif(TORCH < (2, 12), reason="torch 2.11 has no pre_grad_pass_timing (its pre-grad passes run before "
                    "every cache lookup) and, on the H200 with 2.11.0+cu130, served this graph from neither cache")
def test_a_warm_cache_still_reports_every_rewrite(tmp_path):
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False)).to(BF16)
    x = torch.randn(32, 64, dtype=BF16)
    reports, hits = [], []
    inductor_route.install()
    with fresh_cache(dir=str(tmp_path)), torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        for _ in range(2):  # the AOTAutograd cache saves a training graph once its backward is compiled
            torch._dynamo.reset()
            counters.clear()
            with moepass.collecting() as report:
                torch.compile(model, backend="inductor")(x).float().sum().backward()
            reports.append(report)
            hits.append(counters["aot_autograd"]["autograd_cache_hit"])
    cold, warm = reports
    assert hits == [0, 1] and not warm.compiled  # the second compile was served from the AOTAutograd cache
    assert pass_totals(cold)["linear"] == pass_totals(warm)["linear"] == 1  # the output head stays BF16


# ---- torchtitan's own DeepSeek-V3, as shipped --------------------------------------------------------

USER_ARGS = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel", "--compile.enable",
             "--training.seq_len", "128",
             "--override.imports", 'moepass.torchtitan.moepass={"passes": ["grouped_mm", "linear"]}']


@needs_torchtitan
def test_torchtitan_override_installs_the_route_and_claims_no_model_node():
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides

    fused = ["--override.imports", "torchtitan.overrides.fused_swiglu.fused_swiglu,"
             "torchtitan.overrides.fused_swiglu.fused_grouped_experts"]
    config = ConfigManager().parse_args(USER_ARGS[:-2] + fused + USER_ARGS[-1:])
    config.model_spec.model.update_from_config(config=config)
    lines = apply_overrides(config.override, config)  # what the Trainer does before building the model
    assert inductor_route.installed()["passes"] == ("grouped_mm", "linear")
    assert [line for line in lines if "moepass" in line] == [
        "[Override] moepass.torchtitan.moepass: metrics MetricsProcessor.Config -> MetricsProcessor.Config "
        "with passes=['grouped_mm', 'linear']"]
    assert any("fused_grouped_experts" in line for line in lines)  # model overrides apply alongside
    assert config.compile.backend == "inductor"


@pytest.fixture
def dynamo_flags_restored():
    """apply_compile turns capture_scalar_outputs on for the whole process: restored after the test, or later tests in
    this process trace `.tolist()` loops differently (DeepSeek's reference MoE in test_unseen_models.py). Not with
    monkeypatch: pytest 9 restores a module attribute missing from its __dict__ with delattr, which hides a torch
    config entry for the rest of the process ("torch._dynamo.config.capture_scalar_outputs does not exist")."""
    with torch._dynamo.config.patch(capture_scalar_outputs=torch._dynamo.config.capture_scalar_outputs):
        yield


@needs_torchtitan
def test_torchtitan_deepseek_v3_debugmodel_with_flex_through_apply_compile(dynamo_flags_restored):
    from realstack.torchtitan_ep import point_torchtitan_at_cpu
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.tools.utils import set_default_dtype

    point_torchtitan_at_cpu()
    config = ConfigManager().parse_args(USER_ARGS)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    apply_overrides(config.override, config)
    torch.manual_seed(0)
    with torch.device("cpu"), set_default_dtype(BF16):
        model = model_config.build()
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    assert any(isinstance(m, FlexAttention) for m in model.modules())  # the shipped attention
    with pytest.raises(ValueError, match="FlexAttention"):  # why the route exists
        apply_compile(model, compile_config=type(config.compile)(enable=True, backend="moepass"),
                      parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1))
    apply_compile(model, compile_config=config.compile,
                  parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1))

    tokens = torch.randint(0, model_config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(128).unsqueeze(0)
    with moepass.collecting() as report, compile_caches_off(), torch.no_grad():
        masks = model.get_attention_masks(positions)  # torchtitan compiles create_block_mask: no flex template in it
        with vectorized_cpu_code():
            logits = model(tokens, positions, masks)
    assert logits.shape == (1, 128, model_config.vocab_size) and logits.isfinite().all()

    blocks = [g for g in report.graphs if g.module.startswith("layers.")]
    moe = [g for g in blocks if g.ops_after.get("moepass.mxfp8_grouped_mm")]
    assert blocks and moe, [g.where() for g in report.graphs]
    for graph in blocks:
        assert graph.ops_after["flex_attention"] == 1 and graph.ops_after["moepass.mxfp8_linear"] >= 7
    for graph in moe:  # w1, w3, w2 of torchtitan's GroupedExperts; its router gate stays BF16
        assert graph.ops_after["moepass.mxfp8_grouped_mm"] == 3 and "_grouped_mm" not in graph.ops_after
        linear = {p.name: p for p in graph.passes}["linear"]
        assert [s.module for s in linear.skipped] == [f"{graph.module}.moe.router.gate"]
    assert compiled_ops(report, "forward").get("moepass.mxfp8_grouped_mm") == 3 * len(moe)


def check_ep_regions_through_the_route(rank, world_size):
    """torchtitan's expert-parallel MoE block under its selective AC, on this gloo rank, through the route."""
    from realstack import torchtitan_ep as tt

    inductor_route.install({"passes": ["deepep"]})
    titan = tt.build_moe("16B-like", ac="selective")
    with moepass.collecting() as report, compile_caches_off():
        (result,) = tt.train_steps(titan, "inductor", steps=1)
    inductor_route.uninstall()
    (deepep,) = [p for p in report.to_dict()["passes"] if p["name"] == "deepep"]
    assert deepep["replaced"] == 1 and deepep["skipped"] == [], deepep
    assert deepep["rewrites"][0]["node"].startswith("wrap_body"), deepep["rewrites"]
    assert not [k for g in report.graphs for k in g.ops_after if "all_to_all" in k]
    backward = compiled_ops(report, "backward")  # ep_recompute: the recompute sends nothing again
    assert not [k for k in backward if "all_to_all" in k or k == "moepass.ep_dispatch"], backward
    assert backward.get("moepass.ep_dispatch_backward", 0) + backward.get("moepass.ep_combine", 0) == 1, backward
    assert result.loss.isfinite() and all(g.isfinite().all() for g in result.grads.values())


@pytest.mark.extended  # ~95 s on 2 cores; the same pipeline's EP regions are checked in CI by test_torchtitan.py
@needs_torchtitan
def test_torchtitan_ep_regions_under_selective_ac_through_the_route(rank_pool):
    rank_pool(2).run(check_ep_regions_through_the_route, timeout_s=600)


# ---- not installed, and removed -----------------------------------------------------------------------

class _Recorder(CompiledGraphAudit):
    """A post-grad pass of the user's own, recording each compiled graph's GEMMs and moepass ops."""


def _plain_inductor_compile():
    """Compile a BF16 MLP with backend="inductor" (a post-grad recorder of the test's own in the slot moepass uses,
    so nothing of moepass can be in it); the compiled GEMMs and what moepass's reports saw."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False)).to(BF16)
    recorder = _Recorder()
    with moepass.collecting() as report, compile_caches_off(), torch.no_grad(), \
            torch._inductor.config.patch(post_grad_custom_post_pass=recorder):
        torch.compile(model, backend="inductor")(torch.randn(32, 64, dtype=BF16))
    return recorder.sink, report


def test_not_installed_is_a_plain_inductor_compile():
    compiled, report = _plain_inductor_compile()
    assert compiled == [{"kind": "forward", "ops": {"aten.mm": 2}}] and report.graphs == []


def test_uninstall_restores_inductor_dynamo_and_the_decomposition_table():
    from torch._inductor.decomposition import decompositions

    import torch._inductor.config as inductor_config

    names = (*inductor_route.INDUCTOR_SLOTS, "pre_grad_pass_timing")
    before = {n: getattr(inductor_config, n, None) for n in names}
    dynamo = torch._dynamo.config.get_config_copy()
    table = dict(decompositions)
    with inductor_route.route():
        assert inductor_route.installed() is not None
        assert isinstance(inductor_config.pre_grad_custom_pass, inductor_route.MoepassPreGradPass)
        assert torch._dynamo.config.get_config_copy() == dynamo  # its Dynamo flags are per frame (dynamo_flags.py)
        assert torch.ops.moepass.fp8_rowwise_linear.default in decompositions
    assert inductor_route.installed() is None
    assert {n: getattr(inductor_config, n, None) for n in names} == before
    assert torch._dynamo.config.get_config_copy() == dynamo
    assert dict(decompositions) == table
    compiled, report = _plain_inductor_compile()  # and a later compile is untouched
    assert compiled == [{"kind": "forward", "ops": {"aten.mm": 2}}] and report.graphs == []


def test_install_refuses_a_slot_holding_someone_elses_pass():
    with torch._inductor.config.patch(joint_custom_pre_pass=_Recorder()):
        with pytest.raises(ValueError, match="joint_custom_pre_pass"):
            inductor_route.install()
    assert inductor_route.installed() is None and torch._inductor.config.pre_grad_custom_pass is None


@pytest.mark.parametrize("options", [{"inductor": False}, {"inductor.mode": "max-autotune"},
                                     {"inductor.options": {"max_autotune": True}}])
def test_backend_only_inductor_options_are_refused(options):
    with pytest.raises(ValueError, match="torch.compile"):
        inductor_route.install(options)
    assert inductor_route.installed() is None


def test_options_come_from_moepass_options_when_none_are_given(monkeypatch):
    monkeypatch.setenv("MOEPASS_OPTIONS", '{"passes": ["linear"], "lowp.exclude": ["*.out"]}')
    config = inductor_route.install()
    assert config["passes"] == ("linear",) and config["lowp.exclude"] == ("*.out",)


def test_cache_key_holds_the_options():
    a = inductor_route.MoepassPreGradPass(moepass.Config.from_options({"passes": ["linear"]}))
    b = inductor_route.MoepassPreGradPass(moepass.Config.from_options({"passes": ["grouped_mm"]}))
    assert a.uuid() != b.uuid() and a.uuid() == inductor_route.MoepassPreGradPass(a.config).uuid()


# ---- GPU: a flex training step ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_flex_training_step_on_cuda_through_the_route():
    cc = torch.cuda.get_device_capability()
    # Hopper: FP8 rowwise, decomposed into aten._scaled_mm / _scaled_grouped_mm; elsewhere MXFP8 (native on sm_100)
    recipe = "fp8_rowwise" if cc[0] == 9 else "mxfp8"
    options = {"recipe": recipe, "passes": ["grouped_mm", "linear"]}
    # the route settles the recipes' "auto" layout options once for every graph, as if FSDP2 sharded the weights
    # (Inductor's decomposition table is global); the backend settles per graph: give it the route's values
    settled = settle(moepass.Config.from_options(options), inductor_route.WEIGHTS_SHARDED)
    backend_options = {**options, **{key: settled[key] for r in RECIPES.values() for key in r.decomposition_options}}
    results = {}
    for route in (True, False, None):  # None: plain BF16 Inductor, the reference both FP8 runs are judged against
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = FlexMoE(dim=128, heads=2, hidden=128).to("cuda", BF16)
        x = torch.randn(2, 128, 128, dtype=BF16, device="cuda")
        mask = causal_mask(128, "cuda")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if route:
            inductor_route.install(options)
        compile_per_block(model, model.blocks, "moepass" if route is False else "inductor",
                          backend_options if route is False else None)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with moepass.collecting() as report, compile_caches_off():
            loss = model(x, mask).float().square().mean()
            loss.backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        optimizer.step()
        inductor_route.uninstall()
        assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())  # it trained
        results[route] = (loss.detach(), grads, report)

    loss, grads, report = results[True]
    want_loss, want_grads, want_report = results[False]
    assert pass_totals(report) == pass_totals(want_report)
    assert pass_totals(report)["linear"] == 2 * pass_totals(report)["grouped_mm"] == 4 * len(report.graphs)
    forward, backward = compiled_ops(report, "forward"), compiled_ops(report, "backward")
    assert forward == compiled_ops(want_report, "forward") and backward == compiled_ops(want_report, "backward")
    if recipe == "fp8_rowwise":  # the decompositions reached Inductor: its GEMMs are torch's FP8 GEMMs
        assert forward.get("aten._scaled_mm") and forward.get("aten._scaled_grouped_mm"), forward
        assert backward.get("aten._scaled_mm"), backward
    else:
        assert forward.get("moepass.mxfp8_linear") and backward.get("moepass.mxfp8_grouped_mm_dgrad"), backward
    assert loss.isfinite()
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=1e-3)
    # The same graphs: only kernel choices (autotuning) could differ, and an FP8 wgrad turns their last-bit
    # differences into whole e4m3 steps that grow through the FP8 backward (blocks.0.w1, the last wgrad, 4.2%
    # apart by the norm on the H200 with the grouped wgrad in FP8). So each is judged against BF16: the route's
    # gradients as close to BF16's as the backend's, and the other way round; a wrong graph is an error of order one.
    bf16_grads = results[None][1]
    for name, grad in grads.items():
        ref = bf16_grads[name]
        route_error = ((grad - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        backend_error = ((want_grads[name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert max(route_error, backend_error) <= 1.5 * min(route_error, backend_error) + 0.01, (name, route_error,
                                                                                                   backend_error)
        assert backend_error <= 0.25, (name, backend_error)
