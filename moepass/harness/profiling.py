"""The top kernels of a few profiled training steps (named profiling, not profile: that is a stdlib module)."""

from __future__ import annotations

import torch


def profile_table(prof, device: torch.device, top: int = 25) -> list[dict]:
    """Top kernels by self time on the device (ops by self CPU time on CPU)."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    on_device = device.type != "cpu"

    def self_us(e) -> float:
        if on_device:
            return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))
        return float(e.self_cpu_time_total)

    if on_device:  # the kernels themselves, not the CPU ops that launched them nor annotated ranges
        kernels = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
        events = kernels or list(events)
    rows = sorted(events, key=self_us, reverse=True)[:top]
    return [{"name": e.key, "calls": int(e.count), "self_us": self_us(e),
             "total_us": float(getattr(e, "device_time_total", 0.0) if on_device else e.cpu_time_total)}
            for e in rows if self_us(e) > 0]


class StepProfiler:
    """Profiles the last `steps` steps of a run (started and stopped from the train loop's on_step)."""

    def __init__(self, device: torch.device, start_after: int, steps: int, top: int = 25):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof = profile(activities=acts)
        self.device, self.start_after, self.stop_after = device, start_after, start_after + steps
        self.top = top
        self.rows: list[dict] = []

    def on_step(self, step: int) -> None:
        if step == self.start_after - 1:
            self.prof.start()
        elif step == self.stop_after - 1:
            self.prof.stop()
            self.rows = profile_table(self.prof, self.device, self.top)
