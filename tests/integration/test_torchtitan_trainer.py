"""torchtitan 0.3.0's own trainer with moepass: `torchtitan.train.main`, its ConfigManager CLI, its parallelisms.

Each case trains torchtitan's DeepSeek-V3 debugmodel config (tests/fixtures/realstack/titan_configs.py: SDPA attention,
small dims for a 2-core CPU) for 8 steps twice, on the same seed and data: once compiled with moepass, once with
a BF16 reference backend. The ranks are spawned processes started as torchrun would (tests/fixtures/realstack/titan_ranks.py)
running tests/fixtures/realstack/titan_trainer.py, which changes only what a CPU-only torch 2.13 + gloo lacks.

Checked on every rank:
- the loss torchtitan logs at each step within 0.5% of the reference's, the gradient norm within 2% (measured:
  at most 0.1% and 0.7%);
- what the 8 steps changed in each parameter shard (final - initial weights, read around Trainer.train) within
  30% of the reference's change, |d_moepass - d_reference| <= 0.3 |d_reference|. This is the check that sees the
  MoE: at these sizes and steps the loss and gradient norm are the embedding's and output head's, and routing
  every token elsewhere (torchtitan's --debug.moe_force_load_balance) moves them by 0.03% and 0.05% only, but the
  routed experts' and router's updates by 88-131%; moepass's MXFP8 GEMMs moved no parameter's update by more than
  12% (tiny) and 19% (the full-size debugmodel);
- moepass's report of the run (moepass.collecting() around the trainer's main, in-process: every block's graph
  and the loss's, each its own torch.compile call in torchtitan) shows the MoE block rewritten: its routed experts' grouped GEMMs, its attention and shared-expert linears, the router gate kept BF16
  with its reason; with EP the dispatch/combine region, no all-to-all left; under Inductor, the MoE block's
  compiled backward holds the low-precision dgrad/wgrad ops and, with EP, sends nothing again.

In CI (about a minute): FSDP2 + EP=2 on 2 ranks with moepass's `inductor: false` (its passes and ops, run
eagerly) against aot_eager, AC off (torchtitan's AC bodies fail to run eagerly, backend="eager" alike: "one of the
variables needed for gradient computation has been modified by an inplace operation"); and the
pipeline-parallel check. Every layout against Inductor (1 rank, FSDP2 + EP=2 + selective AC, TP=2, and the
full-size debugmodel): pytest -m extended, 3-6 minutes a case on 2 cores with a cold Inductor cache.
"""

from __future__ import annotations

import inspect
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is in the [test] extra")
if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12):
    pytest.skip("torchtitan 0.3.0 needs torch >= 2.12", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "fixtures"))
from realstack.titan_corpus import write_corpus  # noqa: E402
from realstack.titan_ranks import run_trainer  # noqa: E402

TOKENIZER = Path(__file__).parents[1] / "fixtures" / "realstack" / "assets" / "tokenizer"
STEPS = 8
LOSS_RTOL = 5e-3
GRAD_NORM_RTOL = 2e-2
UPDATE_RTOL = 0.3  # |moepass update - reference update| / |reference update|, per parameter shard
MOE_BLOCK_LINEARS = ("attention.wq", "attention.wkv_a", "attention.wkv_b", "attention.wo",
                     "moe.shared_experts.w1", "moe.shared_experts.w2", "moe.shared_experts.w3")


@dataclass
class Route:
    """How torchtitan's trainer reaches moepass: the torchtitan config per model size (--module, --config), and
    the CLI arguments that compile with moepass (the reference run passes --compile.backend <reference>)."""

    name: str
    configs: dict[str, tuple[str, str]]
    moepass_args: tuple[str, ...]


# torchtitan refuses a backend other than inductor/aot_eager for its FlexAttention configs; this route swaps in
# its SDPA attention. The FlexAttention route (`--compile.backend inductor --override.imports
# moepass.torchtitan.moepass` on the `deepseek_v3_debugmodel_tiny` config, or torchtitan's own `deepseek_v3`
# `deepseek_v3_debugmodel`) is one more entry here once these run on a GPU: on CPU its first backward raises
# "FlexAttention does not support backward on CPU".
ROUTES = [
    Route("sdpa", {"tiny": ("realstack.titan_configs", "deepseek_v3_debugmodel_tiny_sdpa"),
                   "debugmodel": ("realstack.titan_configs", "deepseek_v3_debugmodel_sdpa")},
          ("--compile.backend", "moepass")),
]


@dataclass(frozen=True)
class Layout:
    name: str
    world_size: int
    args: tuple[str, ...] = ()
    ep: bool = False


ONE_RANK = Layout("1rank", 1)  # torchtitan's debugmodel default: selective AC, no FSDP on one rank
FSDP_EP2_SAC = Layout("fsdp_ep2_sac", 2, ("--parallelism.expert_parallel_degree", "2"), ep=True)
FSDP_EP2 = Layout("fsdp_ep2", 2, ("--parallelism.expert_parallel_degree", "2", "activation_checkpoint:none"),
                  ep=True)
TP2 = Layout("tp2", 2, ("--parallelism.tensor_parallel_degree", "2"))


@dataclass(frozen=True)
class Case:
    layout: Layout
    reference: str = "inductor"  # the reference run's --compile.backend
    moepass_options: dict = field(default_factory=dict)  # MOEPASS_OPTIONS of the moepass run
    size: str = "tiny"

    @property
    def inductor(self) -> bool:
        return self.moepass_options.get("inductor", True)

    @property
    def id(self) -> str:
        eager = "" if self.inductor else "-moepass_eager"
        return f"{self.layout.name}-{self.size}-vs_{self.reference}{eager}"


IN_CI = [Case(FSDP_EP2, "aot_eager", {"inductor": False})]
EXTENDED = [Case(ONE_RANK), Case(FSDP_EP2_SAC), Case(TP2), Case(ONE_RANK, size="debugmodel")]
CASES = [pytest.param(c, id=c.id) for c in IN_CI] + [pytest.param(c, id=c.id, marks=pytest.mark.extended)
                                                     for c in EXTENDED]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("titan_corpus")).parent


def trainer_args(module: str, config: str, corpus_dir: Path, dump_dir: Path, backend_args: list[str],
                 layout: Layout) -> list[str]:
    """torchtitan CLI arguments: its config, small CPU sizes, CPU-only settings, the backend, then `layout`'s
    (last: tyro reads the options after a subcommand such as `activation_checkpoint:none` as the subcommand's)."""
    return ["--module", module, "--config", config,
            "--hf_assets_path", str(TOKENIZER), "--dataloader.dataset_path", str(corpus_dir),
            "--training.steps", str(STEPS), "--training.seq_len", "128", "--training.local_batch_size", "2",
            "--debug.seed", "0", "--training.disable_cuda_graphs", "--checkpoint.no-enable",
            "--metrics.disable_color_printing", "--dump_folder", str(dump_dir),
            "--parallelism.spmd_backend", "partial_dtensor",  # torchtitan's spmd_types fails torch 2.13's fully_shard
            "--compile.enable", *backend_args, *layout.args]


def train(route: Route, case: Case, corpus_dir: Path, out: Path, *, moepass: bool):
    out.mkdir(parents=True, exist_ok=True)
    module, config = route.configs[case.size]
    backend_args = list(route.moepass_args) if moepass else ["--compile.backend", case.reference]
    args = trainer_args(module, config, corpus_dir, out, backend_args, case.layout)
    env = {"HF_DATASETS_CACHE": str(out / "hf_datasets")}
    if moepass:
        env["MOEPASS_OPTIONS"] = json.dumps(case.moepass_options)
    timeout_s = 1800 if case.size == "debugmodel" else 900
    return run_trainer(args, case.layout.world_size, timeout_s=timeout_s, env=env, updates_dir=out)


def assert_tracks(got: dict[int, float], want: dict[int, float], rtol: float, what: str) -> None:
    assert sorted(want) == list(range(1, STEPS + 1)), f"reference {what} logged for steps {sorted(want)}"
    assert sorted(got) == sorted(want), f"moepass {what} logged for steps {sorted(got)}"
    off = {s: (got[s], want[s]) for s in want
           if not (math.isfinite(got[s]) and abs(got[s] - want[s]) <= rtol * abs(want[s]))}
    assert not off, f"{what} off by more than {rtol:.1%} of the reference at steps {off}"


def assert_same_updates(got: dict, want: dict, where: str) -> None:
    """What 8 steps changed in each parameter shard, moepass's against the reference's."""
    assert sorted(got) == sorted(want), f"{where}: parameters differ"
    rel = {name: ((got[name] - d).norm() / d.norm().clamp_min(1e-12)).item() for name, d in want.items()}
    off = {name: round(r, 3) for name, r in rel.items() if not r <= UPDATE_RTOL}
    assert not off, f"{where}: weight updates off by more than {UPDATE_RTOL:.0%} of the reference's: {off}"


def check_moe_block_rewritten(report: dict | None, layout: Layout, inductor: bool) -> None:
    assert report is not None, "moepass compiled no graph"
    assert report["graph_breaks"] == 0 and report["frames_run_eagerly"] == 0, report["per_graph"]
    passes = {p["name"]: p for p in report["passes"]}
    experts = {r["module"] for r in passes["grouped_mm"]["rewrites"] if ".moe.routed_experts" in r["module"]}
    assert experts and passes["grouped_mm"]["replaced"] >= 3 * len(experts), passes["grouped_mm"]
    linears = {r["module"] for r in passes["linear"]["rewrites"]}
    for block in {m.split(".moe.")[0] for m in experts}:  # each MoE block graph: attention and shared experts
        missing = [f"{block}.{name}" for name in MOE_BLOCK_LINEARS if f"{block}.{name}" not in linears]
        assert not missing, f"linears left BF16: {missing}; skipped: {passes['linear']['skipped']}"
        gate = [s for s in passes["linear"]["skipped"] if s["module"] == f"{block}.moe.router.gate"]
        assert gate and "router gate" in gate[0]["reason"], passes["linear"]["skipped"]
    if layout.ep:
        assert passes["deepep"]["replaced"] >= 1 and passes["deepep"]["skipped"] == [], passes["deepep"]
        assert all(".moe." in r["module"] for r in passes["deepep"]["rewrites"]), passes["deepep"]["rewrites"]
        assert not [k for k in report["ops_after"] if "all_to_all" in k], report["ops_after"]
    if inductor:
        backward = [c["ops"] for c in report["compiled_graphs"]
                    if c["kind"] == "backward" and "moepass.mxfp8_grouped_mm_wgrad" in c["ops"]]
        assert backward, [(c["kind"], c["graph"], c["ops"]) for c in report["compiled_graphs"]]
        for ops in backward:
            assert ops.get("moepass.mxfp8_grouped_mm_dgrad") and ops.get("moepass.mxfp8_linear_wgrad"), ops
            if layout.ep:  # the dispatch/combine outputs are saved: the backward sends no token twice
                assert not [k for k in ops if "all_to_all" in k or k == "moepass.ep_dispatch"], ops


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
@pytest.mark.parametrize("case", CASES)
def test_torchtitan_trainer_with_moepass_tracks_reference(route, case, corpus, tmp_path):
    reference = train(route, case, corpus, tmp_path / "reference", moepass=False)
    runs = train(route, case, corpus, tmp_path / "moepass", moepass=True)
    for want, got in zip(reference, runs):
        where = f"rank {got.rank}"
        assert_tracks(got.losses, want.losses, LOSS_RTOL, f"{where} loss")
        assert_tracks(got.grad_norms, want.grad_norms, GRAD_NORM_RTOL, f"{where} grad norm")
        assert_same_updates(got.updates(), want.updates(), where)
        check_moe_block_rewritten(got.report, case.layout, case.inductor)


@pytest.mark.extended  # an expected failure (below) that takes 2 trainer processes to show
def test_pipeline_parallel(corpus, tmp_path):
    """torchtitan's PP (2 stages of the 4-layer debugmodel, 1F1B) on 2 gloo ranks with moepass: an expected
    failure on torch 2.13, whose schedule step() lacks the pre-split microbatch API torchtitan 0.3.0 calls."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    layout = Layout("pp2", 2, ("--parallelism.pipeline_parallel_degree", "2"))
    args = trainer_args("realstack.titan_configs", "deepseek_v3_debugmodel_tiny4_sdpa", corpus, tmp_path,
                        ["--compile.backend", "moepass"], layout)
    env = {"HF_DATASETS_CACHE": str(tmp_path / "hf_datasets"), "MOEPASS_OPTIONS": "{}"}
    try:
        runs = run_trainer(args, layout.world_size, timeout_s=900, env=env)
    except RuntimeError as e:
        # torchtitan passes step(arg_mbs=, kwarg_mbs=, target_mbs=); torch 2.13's step(*args, **kwargs) takes them
        # for model kwargs and its microbatch check fails before any stage runs (so with any backend, or none)
        if "arg_mbs" not in inspect.signature(PipelineScheduleSingle.step).parameters \
                and "Expecting 2 arg_mbs but got 1" in str(e):
            pytest.xfail("torch 2.13's PipelineSchedule.step has no arg_mbs/kwarg_mbs/target_mbs (torchtitan 0.3.0 "
                         "calls them): ValueError: Expecting 2 arg_mbs but got 1")
        raise
    last = runs[-1]  # the last stage computes the loss
    assert sorted(last.losses) == list(range(1, STEPS + 1)) and all(map(math.isfinite, last.losses.values()))
    for run in runs:  # each stage holds MoE blocks (layers 1 | 2, 3)
        check_moe_block_rewritten(run.report, layout, inductor=True)
