"""torchtitan 0.3.0's own trainer (`torchtitan.train.main`, its ConfigManager CLI) on a CPU-only torch.

    torchrun --standalone --nproc-per-node 2 tests/realstack/titan_trainer.py \
        --module realstack.titan_configs --config deepseek_v3_debugmodel_tiny_sdpa \
        --parallelism.spmd_backend partial_dtensor --compile.enable --compile.backend moepass ...

Arguments go to torchtitan unchanged. Before torchtitan runs, `apply_cpu_shims` changes only what a CPU-only
torch 2.13 + gloo lacks (none of it moepass's doing, none of it in the training math):
1. torchtitan picks its device once, at import, as `_get_available_device_type() or "cuda"`: "cuda" on a
   machine without an accelerator. It is pointed at "cpu" (gloo process groups, CPU tensors), with a device
   module that answers the few `torch.cuda` calls torchtitan makes that `torch.cpu` lacks (current device
   index, and its memory monitor's name/capacity/peak statistics, reported as none).
2. After the first step torchtitan calls `torch.distributed.set_timeout(timeout, group)`, an API only nightly
   torch has; here it sets the same timeout through `ProcessGroup.set_timeout`.
3. FSDP2 reduces gradients with PREMUL_SUM, which gloo refuses; FSDP2's own switch
   `set_force_sum_reduction_for_comms(True)` makes it SUM, then divide (the same mean, scaled after the sum).
4. torchtitan's default `spmd_types` backend fails under torch 2.13's `fully_shard`: pass
   `--parallelism.spmd-backend partial_dtensor` (a CLI argument, not changed here).
The torchtitan tree and its tokenizer are not in the wheel: tests/realstack/assets/ says where they come from.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent


def _point_torchtitan_at_cpu() -> None:
    """Shim 1: every torchtitan module holds `device_type`/`device_module` copied at import from
    torchtitan.tools.utils; set the source, then every copy already made."""
    import torch
    import torchtitan.tools.utils as titan_utils

    if titan_utils.device_type == "cpu" or torch.accelerator.is_available():
        return
    titan_utils.device_type, titan_utils.device_module = "cpu", _CpuDeviceModule()
    import torchtitan.train  # noqa: F401  (imports the trainer's modules, which copy the names above)

    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            if hasattr(module, "device_module"):
                module.device_module = titan_utils.device_module


class _CpuDeviceModule:
    """`torch.cpu` where torchtitan asks what `torch.cuda` answers: the current device as an index, and what its
    device-memory monitor reads (name, capacity, peak stats), which torch.cpu lacks: a CPU with no allocator
    statistics (the log's memory column then reads -0.00GiB)."""

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0  # an index, as torch.cuda's (torch.cpu's is the string "cpu", which barrier(device_ids=) refuses)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=1)  # divides the (absent) memory stats into percentages

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _set_timeout_through_process_group() -> None:
    """Shim 2: nightly torch's `torch.distributed.set_timeout(timeout, group=None)`, as the group's own setter."""
    import torch.distributed as dist

    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group=None) -> None:
        (group or dist.distributed_c10d._get_default_group()).set_timeout(timeout)

    dist.set_timeout = set_timeout


def _fsdp_reduce_with_sum() -> None:
    """Shim 3: each FSDP2 parameter group starts with force_sum_reduction_for_comms=True, what
    `FSDPModule.set_force_sum_reduction_for_comms(True)` sets on it (gloo has no PREMUL_SUM; FSDP2 then
    reduces with SUM and divides after: the same mean)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if getattr(FSDPParamGroup, "_sum_reduction_shim", False):
        return
    init = FSDPParamGroup.__init__

    def init_summing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.force_sum_reduction_for_comms = True

    FSDPParamGroup.__init__ = init_summing
    FSDPParamGroup._sum_reduction_shim = True


def apply_cpu_shims() -> None:
    _point_torchtitan_at_cpu()
    _set_timeout_through_process_group()
    _fsdp_reduce_with_sum()


def main(argv: list[str] | None = None) -> None:
    """torchtitan.train.main with `argv` (default: this process's arguments) after the CPU shims."""
    if str(TESTS_DIR) not in sys.path:  # `--module realstack.titan_configs` imports from tests/
        sys.path.insert(0, str(TESTS_DIR))
    apply_cpu_shims()
    import torchtitan.train

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    torchtitan.train.main()


if __name__ == "__main__":
    main()
