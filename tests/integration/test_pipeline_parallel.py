"""Pipeline parallelism (torch.distributed.pipelining) with moepass compiling each stage's blocks, on gloo ranks.

The debug DeepSeek-V3 (tiny dims) is cut into stages the way torchtitan cuts it: a stage keeps its own blocks under
their model names (`layers.<i>`), the first stage the embeddings, the last the norm and the output head; each block is
compiled on its own with `backend="moepass"` (`block.compile(...)`, as torchtitan compiles per block). The first half
of the layers is dense and the second half MoE, so some stages hold dense blocks only and others MoE blocks only.

Checked on every rank, for GPipe, 1F1B and interleaved 1F1B on 2 and 4 ranks:
- the losses (last stage) and this rank's gradients equal, bit for bit, the unpipelined model's with its blocks
  compiled the same way and run on the same microbatches (losses averaged and gradients accumulated in microbatch
  order, then divided by their number, as the schedules do). Tolerance 0: a stage runs the same compiled graphs on
  the same rows, so pipelining may move where a block runs, never what it computes;
- against the unpipelined BF16 model (uncompiled, the whole batch at once) the mean loss within 1% and every
  gradient within 25% (relative norm): the recipe's own error (MXFP8, emulated: E4M3 keeps 3 mantissa bits), largest
  on the small, noisy gradients of attention `wq` and routed experts at initialisation; measured at most 0.004% (loss)
  and 15% (a routed expert of the 8-layer model), 9% elsewhere;
- the rank's report (moepass.collecting() around the schedule's step) holds its stage's blocks and no other's:
  linears in every block, grouped expert GEMMs in MoE stages only, the router gate left BF16 with its reason.
The unpipelined references are the same on every rank: one rank runs each and sends it to the others (rank_shared).

With expert parallelism inside the stages (4 ranks: 2 stages x EP 2, each stage's MoE blocks exchanging tokens
within its EP pair, each PP pair fed its half of the batch) the EP region is rewritten on every rank (no all-to-all
left); losses and expert gradients equal the EP=1 model's on the whole batch bit for bit, and replicated gradients
summed over the EP pair within 2**-6 of their norm (each rank accumulates its half over the microbatches in BF16
before the sum; measured 0.46%).

torchtitan 0.3.0's pipeline step (its Trainer.pp_forward_backward_step) is run as written: an expected failure
while torch's schedules take no pre-split microbatches (torch 2.12-2.13; .notes/pp.md says why).
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.distributed as dist
from helpers import TINY
from rank_shared import computed_apart, rank_pool, waiting_group  # noqa: F401  (rank_pool: a fixture)
from torch import nn

BF16 = torch.bfloat16
MICROBATCHES = 4
MICROBATCH_SIZE = 2
SEQ_LEN = 16
OPTIONS = {"inductor": False}  # moepass's passes and ops run eagerly: Inductor's CPU compile is minutes per rank
LOSS_RTOL_BF16 = 1e-2
GRAD_RTOL_BF16 = 0.25
REPLICATED_EP_TOL = 2**-6
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


class StageModule(nn.Module):
    """The part of a DeepSeekV3 one pipeline stage runs (torchtitan's split: blocks keep their model names)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.rope = model.rope
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        rope_cos, rope_sin = self.rope(h.shape[1])
        for layer in self.layers.values():
            h = layer(h, rope_cos, rope_sin)
        return self.output(self.norm(h)) if self.output is not None else h


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


def _capture_flags():
    # EP regions need host split sizes and data-dependent row counts in one graph; set here, not relied on at import
    return torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True)


def _build(n_layers: int, n_dense: int | None = None, ep_group=None):
    """The tiny debug DeepSeek-V3, the same weights on every rank; the first half of the layers dense by default."""
    from moepass.models import build_model

    torch.manual_seed(0)
    n_dense = n_layers // 2 if n_dense is None else n_dense
    return build_model("debug", ep_group=ep_group, **{**TINY, "n_layers": n_layers, "n_dense_layers": n_dense})


def _compile_blocks(model_or_stage: nn.Module) -> None:
    """Each block on its own, as torchtitan compiles (a stage holds a ModuleDict of blocks, the model a list)."""
    layers = model_or_stage.layers
    for block in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        block.compile(backend="moepass", options=OPTIONS)


def _batch(batch_size: int, vocab: int, seed: int = 1):
    tokens = torch.randint(0, vocab, (batch_size, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _layers_of(stage: int, num_stages: int, n_layers: int) -> range:
    per_stage = n_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def _schedule(name: str, stages, loss_fn):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "Interleaved1F1B":
        return ScheduleInterleaved1F1B(stages, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    (stage,) = stages
    return {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[name](stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)


def _pipeline_stage(module: StageModule, stage: int, num_stages: int, dim: int, vocab: int, group=None):
    """A PipelineStage with its microbatch's input and output shapes given (meta, training: gradients flow), so
    that no shape inference runs the compiled blocks on meta tensors."""
    from torch.distributed.pipelining import PipelineStage

    meta = torch.device("meta")
    inputs = (torch.empty(MICROBATCH_SIZE, SEQ_LEN, dtype=torch.int64, device=meta) if stage == 0
              else torch.empty(MICROBATCH_SIZE, SEQ_LEN, dim, dtype=BF16, device=meta, requires_grad=True))
    outputs = torch.empty(MICROBATCH_SIZE, SEQ_LEN, vocab if stage == num_stages - 1 else dim, dtype=BF16, device=meta,
                          requires_grad=True)  # torch 2.13 receives output gradients only for outputs that need them
    return PipelineStage(module, stage, num_stages, torch.device("cpu"), input_args=inputs, output_args=outputs,
                         group=group)


def _step(schedule, has_first: bool, has_last: bool, tokens, targets) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    args = (tokens,) if has_first else ()
    kwargs = {"target": targets, "losses": losses} if has_last else {}
    schedule.step(*args, **kwargs)
    return losses


def _unpipelined(model: nn.Module, tokens, targets, loss_of, scale: int = MICROBATCHES) -> list[torch.Tensor]:
    """Per microbatch: loss and backward in order; then gradients / scale (the schedules' scale_grads)."""
    losses = []
    for mb_tokens, mb_targets in zip(tokens.tensor_split(MICROBATCHES), targets.tensor_split(MICROBATCHES)):
        loss = loss_of(model(mb_tokens), mb_targets)
        loss.backward()
        losses.append(loss.detach())
    for param in model.parameters():
        param.grad.div_(scale)
    return losses


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _pass_records(report) -> dict:
    return {p["name"]: p for p in report.to_dict()["passes"]}


def _assert_stage_report(report, layers: list[int], n_dense: int, ep: bool) -> None:
    """Every rewrite names one of this rank's blocks; MoE blocks get grouped GEMMs (and with EP a dispatch), dense
    ones linears only."""
    passes = _pass_records(report)
    mine = tuple(f"layers.{i}." for i in layers)
    rewritten = [r["module"] for p in passes.values() for r in p["rewrites"]]
    assert rewritten and all(m.startswith(mine) for m in rewritten), (layers, sorted(set(rewritten)))
    moe_layers = [i for i in layers if i >= n_dense]
    assert any(".attention." in m for m in rewritten), rewritten
    if moe_layers:
        grouped = [r["module"] for r in passes["grouped_mm"]["rewrites"]]
        assert grouped and all(m.endswith(".moe.experts") for m in grouped), grouped
        assert any(s["module"].endswith(".moe.router.gate") for s in passes["linear"]["skipped"])
    else:
        assert passes["grouped_mm"]["replaced"] == 0 and passes["deepep"]["replaced"] == 0
        assert any(".feed_forward." in m for m in rewritten), rewritten
    if ep and moe_layers:
        assert passes["deepep"]["replaced"] >= 1 and passes["deepep"]["skipped"] == [], passes["deepep"]
        ops = report.to_dict()["ops_after"]
        assert not [k for k in ops if "all_to_all" in k], ops


# ---------------------------------------------------------------- PP alone: GPipe, 1F1B, interleaved 1F1B


def check_pipeline_matches_unpipelined(rank, world_size, schedule_name):
    import moepass

    torch._dynamo.reset()  # ranks are kept across tests: each check compiles its own blocks
    stages_per_rank = 2 if schedule_name == "Interleaved1F1B" else 1
    num_stages = world_size * stages_per_rank
    n_layers = max(4, num_stages)
    n_dense = n_layers // 2
    model = _build(n_layers)
    config = model.config
    stage_ids = [rank + k * world_size for k in range(stages_per_rank)]  # looped placement (interleaved)
    modules = [StageModule(model, _layers_of(s, num_stages, n_layers), s == 0, s == num_stages - 1)
               for s in stage_ids]
    del model  # as torchtitan's split leaves it: each block owned by its stage only (one path per module)
    for module in modules:
        _compile_blocks(module)
    stages = [_pipeline_stage(m, s, num_stages, config.dim, config.vocab_size) for m, s in zip(modules, stage_ids)]
    schedule = _schedule(schedule_name, stages, next_token_loss)
    tokens, targets = _batch(MICROBATCHES * MICROBATCH_SIZE, config.vocab_size)
    has_first, has_last = 0 in stage_ids, num_stages - 1 in stage_ids
    with moepass.collecting() as report:
        losses = _step(schedule, has_first, has_last, tokens, targets)

    layers = [i for s in stage_ids for i in _layers_of(s, num_stages, n_layers)]
    _assert_stage_report(report, layers, n_dense, ep=False)

    (want_losses, ref_grads), (bf16_loss, bf16_grads) = _reference_runs(n_layers, tokens, targets)
    mine = {name: p for m in modules for name, p in m.named_parameters()}
    assert mine and all(p.grad is not None for p in mine.values())
    if has_last:
        assert len(losses) == MICROBATCHES
        assert torch.equal(torch.stack(losses), torch.stack(want_losses)), (losses, want_losses)
    differ = [n for n, p in mine.items() if not torch.equal(p.grad, ref_grads[n])]
    assert not differ, f"rank {rank}: gradients differ from the unpipelined model's: {differ}"

    # the recipe's noise: the whole batch through the uncompiled BF16 model
    grad_gaps = {n: _rel(p.grad, bf16_grads[n]) for n, p in mine.items()}
    worst = max(grad_gaps, key=grad_gaps.get)
    assert grad_gaps[worst] <= GRAD_RTOL_BF16, (worst, grad_gaps[worst])
    loss_gap = 0.0
    if has_last:
        loss_gap = abs(torch.stack(losses).mean().item() - bf16_loss.item()) / bf16_loss.item()
        assert loss_gap <= LOSS_RTOL_BF16, loss_gap
    print(f"[pp {schedule_name} x{world_size}] rank {rank} layers {layers}: vs BF16 loss {loss_gap:.2e}, "
          f"worst grad {grad_gaps[worst]:.2e} ({worst})", flush=True)


_reference_cache: dict = {}  # per rank process: (n_layers, batch) -> _reference_runs' result


def _reference_runs(n_layers: int, tokens, targets):
    """((losses, grads) of the unpipelined model with its blocks compiled alike, run microbatch by microbatch),
    ((loss, grads) of the uncompiled BF16 model on the whole batch). The same on every rank and for every schedule
    with n_layers: rank 0 runs the first while rank 1 runs the second, every rank gets both, once per pool."""
    key = (n_layers, tuple(tokens.shape), tokens.sum().item(), targets.sum().item())
    if key not in _reference_cache:
        def compiled():
            reference = _build(n_layers)
            _compile_blocks(reference)
            losses = _unpipelined(reference, tokens, targets, next_token_loss)
            return losses, {n: p.grad for n, p in reference.named_parameters()}

        def bf16():
            model = _build(n_layers)
            loss = next_token_loss(model(tokens), targets)
            loss.backward()
            return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

        runs = computed_apart({0: compiled, 1: bf16}, waiting_group())
        _reference_cache[key] = runs[0], runs[1]
    return _reference_cache[key]


EXTENDED = pytest.mark.extended  # the rest of the matrix; CI keeps every schedule, both rank counts and PP x EP


@pytest.mark.parametrize("world_size, schedule_name", [
    (2, "GPipe"),
    pytest.param(2, "1F1B", marks=EXTENDED),
    (2, "Interleaved1F1B"),
    pytest.param(4, "GPipe", marks=EXTENDED),
    (4, "1F1B"),
    pytest.param(4, "Interleaved1F1B", marks=EXTENDED),
])
def test_pipeline_stages_compiled_with_moepass_match_unpipelined(world_size, schedule_name, rank_pool):
    rank_pool(world_size).run(check_pipeline_matches_unpipelined, schedule_name, timeout_s=300)


# ---------------------------------------------------------------- PP x EP: 2 stages x EP 2 on 4 ranks


def check_pipeline_with_expert_parallel_stages(rank, world_size, schedule_name):
    import moepass
    from moepass.models.expert_parallel import shard_experts

    torch._dynamo.reset()
    pp_size, ep_size = 2, world_size // 2
    stage, ep_rank = divmod(rank, ep_size)  # ranks [0, 1] run stage 0, [2, 3] stage 1
    ep_groups = [dist.new_group(list(range(s * ep_size, (s + 1) * ep_size))) for s in range(pp_size)]
    pp_groups = [dist.new_group([s * ep_size + e for s in range(pp_size)]) for e in range(ep_size)]
    ep_group, pp_group = ep_groups[stage], pp_groups[ep_rank]
    n_layers, n_dense = 4, 1  # both stages hold MoE blocks: layers 0 (dense), 1 | 2, 3
    model = _build(n_layers, n_dense, ep_group)
    model.load_full_state_dict(_build(n_layers, n_dense).state_dict())
    config = model.config
    layers = list(_layers_of(stage, pp_size, n_layers))
    module = StageModule(model, range(layers[0], layers[-1] + 1), stage == 0, stage == pp_size - 1)
    del model
    _compile_blocks(module)
    pipeline_stage = _pipeline_stage(module, stage, pp_size, config.dim, config.vocab_size, group=pp_group)
    schedule = _schedule(schedule_name, [pipeline_stage], next_token_loss)

    # each PP pair gets its half of the batch (EP borrows the data-parallel ranks)
    tokens, targets = _batch(ep_size * MICROBATCHES * MICROBATCH_SIZE, config.vocab_size)
    halves = [t.view(MICROBATCHES, ep_size, MICROBATCH_SIZE, SEQ_LEN) for t in (tokens, targets)]
    my_tokens, my_targets = (h[:, ep_rank].reshape(-1, SEQ_LEN) for h in halves)
    with _capture_flags(), moepass.collecting() as report:
        losses = _step(schedule, stage == 0, stage == pp_size - 1, my_tokens, my_targets)
    _assert_stage_report(report, layers, n_dense, ep=True)

    # the EP=1 model on the whole batch, microbatch by microbatch, each EP rank's half its own loss: the same on
    # every rank, so rank 0 runs it and sends it to the others
    def ep1_reference():
        reference = _build(n_layers, n_dense)
        _compile_blocks(reference)
        seen = []

        def pair_losses(logits, mb_targets):
            split = (logits.view(ep_size, MICROBATCH_SIZE, SEQ_LEN, -1),
                     mb_targets.view(ep_size, MICROBATCH_SIZE, SEQ_LEN))
            per_rank = [next_token_loss(split[0][e], split[1][e]) for e in range(ep_size)]
            seen.append([loss.detach() for loss in per_rank])
            return sum(per_rank)

        whole_tokens, whole_targets = (h.reshape(-1, SEQ_LEN) for h in halves)  # microbatch-major: mb i = both halves
        _unpipelined(reference, whole_tokens, whole_targets, pair_losses)
        return seen, {n: p.grad for n, p in reference.named_parameters()}

    seen, ref_grads = computed_apart({0: ep1_reference}, waiting_group())[0]
    if stage == pp_size - 1:
        want_losses = [per_rank[ep_rank] for per_rank in seen]
        assert torch.equal(torch.stack(losses), torch.stack(want_losses)), (losses, want_losses)
    worst = 0.0
    for name, param in module.named_parameters():
        want = ref_grads[name]
        if ".moe.experts." in name:
            assert torch.equal(param.grad, shard_experts(want, ep_rank, ep_size)), name
            continue
        summed = param.grad.float()
        dist.all_reduce(summed, group=ep_group)  # the data-parallel sum the EP pair would do
        err = _rel(summed, want)
        assert err <= REPLICATED_EP_TOL, (name, err)
        worst = max(worst, err)
    print(f"[pp x ep {schedule_name}] rank {rank} stage {stage} ep {ep_rank}: replicated grads {worst:.2e} (norm)",
          flush=True)


@pytest.mark.parametrize("schedule_name", ["1F1B", pytest.param("GPipe", marks=EXTENDED)])
def test_expert_parallel_stages_rewrite_their_ep_regions(schedule_name, rank_pool):
    rank_pool(4).run(check_pipeline_with_expert_parallel_stages, schedule_name, timeout_s=300)


# ---------------------------------------------------------------- torchtitan 0.3.0's pipeline step, as it calls it

def _schedule_takes_presplit_microbatches() -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    return "arg_mbs" in inspect.signature(PipelineScheduleSingle.step).parameters


class PreSplitMicrobatchesRefused(Exception):
    """The schedule's step() took torchtitan's pre-split microbatch lists as model kwargs and re-split them."""


def check_torchtitan_pp_step(rank, world_size):
    import contextlib
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B
    from torchtitan.trainer import Trainer

    torch._dynamo.reset()
    num_stages = world_size
    n_layers = 4
    model, reference = _build(n_layers), _build(n_layers)
    config = model.config
    module = StageModule(model, _layers_of(rank, num_stages, n_layers), rank == 0, rank == num_stages - 1)
    del model
    _compile_blocks(module)
    stage = _pipeline_stage(module, rank, num_stages, config.dim, config.vocab_size)
    tokens, targets = _batch(MICROBATCHES * MICROBATCH_SIZE, config.vocab_size)
    valid_tokens = torch.tensor(float(targets.numel()))

    def loss_fn(logits, labels, global_valid_tokens):  # torchtitan's: a sum over tokens / all valid tokens
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(),
                                                 reduction="sum") / global_valid_tokens

    trainer = SimpleNamespace(
        pp_has_first_stage=rank == 0, pp_has_last_stage=rank == num_stages - 1, device=torch.device("cpu"),
        pp_schedule=Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn, scale_grads=False),
        train_context=contextlib.nullcontext,
        post_dataloading_process=lambda inputs, labels: (inputs["input"], labels, {}))
    loss = Trainer.pp_forward_backward_step(
        trainer, input_dict_mbs=[{"input": t} for t in tokens.tensor_split(MICROBATCHES)],
        label_mbs=list(targets.tensor_split(MICROBATCHES)), global_valid_tokens=valid_tokens)

    _compile_blocks(reference)
    want = _unpipelined(reference, tokens, targets, lambda out, t: loss_fn(out, t, valid_tokens), scale=1)
    if rank == num_stages - 1:
        assert torch.equal(loss, torch.sum(torch.stack(want))), (loss, want)
    ref_params = dict(reference.named_parameters())
    differ = [n for n, p in module.named_parameters() if not torch.equal(p.grad, ref_params[n].grad)]
    assert not differ, differ


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12),
                    reason="torchtitan 0.3.0 needs torch >= 2.12")
@pytest.mark.xfail(
    "not _schedule_takes_presplit_microbatches()", strict=True, raises=PreSplitMicrobatchesRefused,
    reason="torchtitan 0.3.0's Trainer.pp_forward_backward_step calls pp_schedule.step(arg_mbs=, kwarg_mbs=, "
           "target_mbs=) (pytorch/torchtitan#3856); torch 2.13's step(*args, target=, losses=, **kwargs) has no such "
           "parameters (pytorch/pytorch#188500 adds them), takes them as model kwargs, splits each microbatch along "
           "its batch dim again and raises 'ValueError: Expecting 4 arg_mbs but got 2' (got = min(microbatches, "
           "microbatch size)) before any stage runs")
def test_torchtitan_pipeline_step_with_moepass_stages(rank_pool):
    pytest.importorskip("torchtitan")
    try:
        rank_pool(2).run(check_torchtitan_pp_step, timeout_s=300)
    except pytest.fail.Exception as e:
        if re.search(rf"ValueError: Expecting {MICROBATCHES} arg_mbs but got {min(MICROBATCHES, MICROBATCH_SIZE)}\b",
                     str(e)):
            raise PreSplitMicrobatchesRefused(str(e)) from None
        raise
