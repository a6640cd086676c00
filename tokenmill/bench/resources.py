"""What a benchmark run cost the machine: peak memory and utilization over the measured window.

CPU utilization = process CPU time / wall time / usable cores (100 % = every core busy). Peak RSS is
sampled during the window (and the process-lifetime peak from getrusage is kept beside it). On a GPU,
peak allocated memory comes from torch and utilization from NVML when pynvml is installed.
"""
from __future__ import annotations

import os
import resource
import threading
import time


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _utilization(cpu_s: float, wall_s: float, cores: int) -> float | None:
    """Percent of `cores` busy. Linux adds a thread's CPU time to the process clock lazily (at a tick or a
    switch), so over a short window time run before it can land inside it and the raw ratio can pass 100 %
    (105 % seen over a ~0.1 s run); no process can use more than its cores, so the figure stops at 100."""
    return min(100.0, 100.0 * cpu_s / wall_s / cores) if wall_s > 0 else None


class ResourceMonitor:
    """with ResourceMonitor() as mon: ...; mon.summary() -> dict for the result file."""

    def __init__(self, interval_s: float = 0.05, device: str = "cpu"):
        self.interval_s, self.device = interval_s, device
        self.peak_rss = 0
        self.gpu_util: list[float] = []
        self._stop = threading.Event()
        self._nvml = None

    def __enter__(self):
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats()
            try:
                import pynvml

                pynvml.nvmlInit()
                from tokenmill.nvml import device_handle
                self._nvml = device_handle(pynvml, torch.cuda.current_device())
            except Exception:  # NVML is optional
                self._nvml = None
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            rss = _rss_bytes()
            if rss:
                self.peak_rss = max(self.peak_rss, rss)
            if self._nvml is not None:
                import pynvml

                try:
                    self.gpu_util.append(float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml).gpu))
                except pynvml.NVMLError:  # e.g. a MIG slice has no utilization counter: keep sampling memory
                    self._nvml = None
            if self._stop.wait(self.interval_s):
                return

    def __exit__(self, *exc):
        self.cpu_s = time.process_time() - self._cpu0
        self.wall_s = time.perf_counter() - self._wall0
        self._stop.set()
        self._thread.join()
        return False

    def summary(self) -> dict:
        cores = _cores()
        out = {
            "peak_rss_mb": self.peak_rss / 2**20 if self.peak_rss else None,
            "lifetime_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
            "cpu_utilization": _utilization(self.cpu_s, self.wall_s, cores),
            "cpu_cores": cores,
            "peak_gpu_memory_mb": None,
            "gpu_utilization": sum(self.gpu_util) / len(self.gpu_util) if self.gpu_util else None,
        }
        if self.device.startswith("cuda"):
            import torch

            out["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return out
