"""torchtitan's trainer on N spawned CPU ranks (what torchrun would start), each rank's losses and moepass report.

    runs = run_trainer(argv, world_size=2, timeout_s=600, updates_dir=tmp)   # argv: torchtitan CLI arguments
    runs[r].losses        # {step: loss} as rank r's torchtitan logged it ("step: 1  loss: 7.12345 ...")
    runs[r].grad_norms    # {step: gradient norm} from the same line
    runs[r].report        # moepass.collecting()'s report of every graph moepass compiled on rank r (or None)
    runs[r].updates()     # {parameter: its shard on rank r after training minus before} (with updates_dir)

Each rank is a fresh spawned process with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR
127.0.0.1, a free MASTER_PORT) running tests/realstack/titan_trainer.py's main: torchtitan's own init_distributed
makes the gloo group, and its main() tears it down. A rank that fails, or a run past `timeout_s` (every rank is
then killed), fails the call with the rank's traceback and log tail.
"""

from __future__ import annotations

import logging
import os
import queue as queue_module
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch.multiprocessing as mp

# torchtitan's MetricsProcessor.log: f"step: {step:2}  loss: {global_avg_loss:8.5f}  grad_norm: {grad_norm:7.4f} ..."
STEP_METRICS = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+)\s+grad_norm:\s*(\S+)")
OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class RankRun:
    rank: int
    losses: dict[int, float] = field(default_factory=dict)
    grad_norms: dict[int, float] = field(default_factory=dict)
    report: dict | None = None
    log_tail: list[str] = field(default_factory=list)
    updates_path: str | None = None

    def updates(self) -> dict:
        import torch

        return torch.load(self.updates_path)


class _StepMetrics(logging.Filter):
    """A filter on the root logger (torchtitan's init_logger replaces the root's handlers, not its filters):
    keeps the last lines' text (for a failure message) and each step's loss and gradient norm."""

    def __init__(self, run: RankRun):
        super().__init__()
        self.run = run

    def filter(self, record: logging.LogRecord) -> bool:
        message = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())
        self.run.log_tail = (self.run.log_tail + [message])[-30:]
        match = STEP_METRICS.search(message)
        if match:
            step = int(match.group(1))
            self.run.losses[step], self.run.grad_norms[step] = float(match.group(2)), float(match.group(3))
        return True


def _local_parameters(trainer) -> dict:
    """Each parameter's shard on this rank (a DTensor's local tensor) in fp32, by name without wrapper segments."""
    from torch.distributed.tensor import DTensor

    params = {}
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
                name = name.replace(wrapper, "")
            params[name] = (p.to_local() if isinstance(p, DTensor) else p).detach().float().clone()
    return params


def _save_weight_updates(path: str) -> None:
    """Around torchtitan's Trainer.train: save what training changed in each parameter shard (after - before) to
    `path`. It only reads the parameters, before the first step and after the last."""
    import torch
    from torchtitan.trainer import Trainer

    train = Trainer.train

    def train_and_save(self):
        before = _local_parameters(self)
        result = train(self)
        after = _local_parameters(self)
        torch.save({name: after[name] - before[name] for name in before}, path)
        return result

    Trainer.train = train_and_save


def _rank_main(rank: int, world_size: int, port: int, argv: list[str], env: dict, updates_dir: str | None,
               results) -> None:
    os.environ.update({**OFFLINE_ENV, **env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    run = RankRun(rank)
    logging.getLogger().addFilter(_StepMetrics(run))  # torchtitan logs to the root logger
    error = None
    try:
        import moepass
        from realstack import titan_trainer

        if updates_dir is not None:
            run.updates_path = os.path.join(updates_dir, f"updates_rank{rank}.pt")
            _save_weight_updates(run.updates_path)
        with moepass.collecting() as report:
            titan_trainer.main(argv)
        run.report = report.to_dict() if report.graphs else None
    except BaseException:
        error = traceback.format_exc()
    results.put((run, error))
    results.close()
    results.join_thread()
    os._exit(0)  # interpreter teardown after torch takes seconds; nothing is left to flush


def run_trainer(argv: list[str], world_size: int = 1, *, timeout_s: float = 600, env: dict | None = None,
                updates_dir: str | Path | None = None) -> list[RankRun]:
    """torchtitan's trainer main(argv) on `world_size` spawned ranks; their RankRuns, by rank."""
    from helpers import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    updates_dir = None if updates_dir is None else str(updates_dir)
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, list(argv), env, updates_dir, results))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    runs, failures, dead_polls = {}, [], 0
    try:
        while len(runs) < world_size and not failures and time.monotonic() < deadline:
            try:
                run, error = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if r not in runs and p.exitcode is not None]
                dead_polls = dead_polls + 1 if dead else 0
                if dead_polls > 2:  # exited with no result (a crash, a signal): its peers would wait for the deadline
                    failures.append(f"ranks {dead} exited with codes {[procs[r].exitcode for r in dead]}, no result")
                continue
            runs[run.rank] = run
            if error is not None:  # the other ranks wait on it in a collective: stop them now
                failures.append(f"rank {run.rank}:\n{error}\nlog tail:\n" + "\n".join(run.log_tail[-10:]))
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(runs) == world_size and not failures else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    hung = sorted(set(range(world_size)) - set(runs))
    if failures or hung:
        raise RuntimeError("\n".join(failures) + (f"\nranks {hung} gave no result within {timeout_s}s"
                                                  if hung and not failures else ""))
    return [runs[r] for r in range(world_size)]
