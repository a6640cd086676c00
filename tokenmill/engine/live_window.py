"""The last minute of the server's latencies and counts, for the live dashboard (/dashboard/data): what
Prometheus histograms cannot give without a scraper, percentiles over a sliding window."""
from __future__ import annotations

import time
from collections import deque

import numpy as np

WINDOW_S = 60.0
SERIES = ("ttft", "tpot", "itl", "e2e")


class LiveWindow:
    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.samples = {name: deque() for name in SERIES}  # (time, seconds)
        self.arrivals: deque = deque()  # (time, requests)
        self.finished: deque = deque()  # (time, output tokens)

    def observe(self, name: str, seconds: float, now: float | None = None) -> None:
        self.samples[name].append((now or time.time(), seconds))

    def arrived(self, n: int, now: float | None = None) -> None:
        self.arrivals.append((now or time.time(), n))

    def done(self, output_tokens: int, now: float | None = None) -> None:
        self.finished.append((now or time.time(), output_tokens))

    def snapshot(self, now: float | None = None) -> dict:
        """P50/P90/P99 in ms per series, plus rates per second, over the window."""
        now = now or time.time()
        cut = now - self.window_s
        for q in (*self.samples.values(), self.arrivals, self.finished):
            while q and q[0][0] < cut:
                q.popleft()
        out = {"window_s": self.window_s}
        for name, q in self.samples.items():
            vals = np.fromiter((v for _, v in q), dtype=np.float64, count=len(q))
            for p in (50, 90, 99):
                out[f"{name}_p{p}_ms"] = float(np.percentile(vals, p) * 1e3) if len(vals) else None
        span = min(self.window_s, max(1e-9, now - min((q[0][0] for q in (self.arrivals, self.finished) if q),
                                                          default=now)))
        out["request_rate"] = sum(n for _, n in self.arrivals) / span if self.arrivals else 0.0
        out["finished_rate"] = len(self.finished) / span if self.finished else 0.0
        return out


class CpuMeter:
    """Machine-wide CPU utilization (%) between calls, from /proc/stat (Linux); None elsewhere."""

    def __init__(self):
        self._last = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    def percent(self) -> float | None:
        cur = self._read()
        if cur is None or self._last is None:
            return None
        total, idle = cur[0] - self._last[0], cur[1] - self._last[1]
        self._last = cur
        return 100.0 * (1 - idle / total) if total > 0 else 0.0
