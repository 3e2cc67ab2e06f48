"""Peak memory of one variant's run: CUDA's allocator peak, else the process's peak RSS."""

from __future__ import annotations

import torch


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of one variant: CUDA max allocated, else process peak RSS (Linux VmHWM, reset per variant)."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.kind = "cuda_max_memory_allocated"
        elif _proc_status_bytes("VmHWM") is not None and self._can_reset_rss_peak():
            self.kind = "process_peak_rss"
        else:
            self.kind = "process_peak_rss_since_start"  # cannot reset: a lifetime peak, not per variant

    @staticmethod
    def _can_reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the peak RSS (VmHWM) to the current RSS
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.kind == "process_peak_rss":
            self._can_reset_rss_peak()

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.kind.startswith("process_peak_rss"):
            return _proc_status_bytes("VmHWM")
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
