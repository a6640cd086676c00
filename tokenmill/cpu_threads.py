"""OpenMP defaults that hold up on shared machines (issue 12; measured in BENCHMARKS.md, "CPU contention").

torch's CPU kernels and ours run on libgomp. By default a libgomp thread that reaches the end of a
parallel region spins (~300,000 iterations) before it sleeps. When another process takes one of the
cores, every region then waits for the thread that lost its core while its partner burns the other one,
and a decode step of many small regions slows down 25-100x. A short spin keeps the idle machine's
back-to-back regions hot and lets a waiting thread give its core up sooner; the ThreadGovernor below
does the rest, by running fewer threads while cores are taken.

These apply only where the user set none of them, and only before the OpenMP runtime loads (it reads
its environment once, when torch is imported): `import tokenmill` does it first thing, and so do the
engine-core process and the CLI, which import tokenmill before torch.
"""
from __future__ import annotations

import os
import sys
import time

# 30,000 rather than issue 12's 10,000: with the governor below, a competing process slows a request no more
# (1.7-1.9x against 1.7-2.2x), and idle decoding gains (AWQ at batch 1: +4-8 %) from regions that start hot
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "30000"}
_USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# True when torch was imported before tokenmill, so libgomp had read its settings already
applied_too_late = False


def apply_openmp_defaults() -> None:
    global applied_too_late
    if any(k in os.environ for k in _USER_KNOBS):
        return  # the user's choice stands
    os.environ.update(OPENMP_DEFAULTS)
    applied_too_late = "torch" in sys.modules


def _read_counters(cpus: set[int]) -> tuple[float, float]:
    """(seconds this process's threads have waited for a CPU, idle CPU-seconds of `cpus`), both cumulative.
    Linux /proc: schedstat's second field is run-queue wait in ns; /proc/stat counts idle in clock ticks."""
    wait = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                wait += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended
    idle = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                idle += int(fields[3]) + int(fields[4])  # idle + iowait
    return wait / 1e9, idle / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    """Runs fewer CPU threads while other processes take cores, and all of them again once cores are free.

    No static OpenMP setting holds up both ways (BENCHMARKS.md, "CPU contention"): with every core's worth
    of threads, a neighbour that takes one core makes each parallel region wait for the thread that lost
    it (10-100x slower); sleeping at once at barriers survives that but costs 10-30 % on a quiet machine.
    So the engine watches, every `window_s` of stepping, how long its threads waited for a CPU:

        waited > drop_at cores, `patience` windows in a row -> one thread fewer (not below 1); a burst
                                                              (the process's own tokenizer threads, say) is not a neighbour
        idle   > raise_at cores of ours over the window    -> one thread more (not above the start),
                                                              no sooner than hold_s after a drop

    Thread counts change only between steps. A GEMM library may split a reduction differently at another
    thread count, so logits can differ in their last bits between counts, as between two machines.
    """

    def __init__(self, max_threads: int, set_threads, window_s: float = 0.2, hold_s: float = 2.0,
                 drop_at: float = 0.3, raise_at: float = 0.75, patience: int = 2, read=None, clock=time.monotonic):
        self.max_threads = self.threads = max_threads
        self._set, self._clock = set_threads, clock
        self.window_s, self.hold_s, self.drop_at, self.raise_at = window_s, hold_s, drop_at, raise_at
        self.patience, self._hot = patience, 0
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self._read = read or (lambda: _read_counters(cpus))
        self._hold_until = 0.0
        self.num_changes = 0
        self._t0 = self._clock()
        self._wait0, self._idle0 = self._read()

    def tick(self) -> None:
        """Call once per engine step; cheap unless a window has passed."""
        now = self._clock()
        dt = now - self._t0
        if dt < self.window_s:
            return
        wait, idle = self._read()
        waited, idle_cores = (wait - self._wait0) / dt, (idle - self._idle0) / dt
        self._hot = self._hot + 1 if waited > self.drop_at else 0
        if self.threads > 1 and self._hot >= self.patience:
            self._change(self.threads - 1)
            self._hot = 0
            self._hold_until = now + self.hold_s
        elif self.threads < self.max_threads and idle_cores > self.raise_at and now >= self._hold_until:
            self._change(self.threads + 1)
        self._t0, self._wait0, self._idle0 = now, wait, idle

    def _change(self, n: int) -> None:
        self.threads = n
        self.num_changes += 1
        self._set(n)
