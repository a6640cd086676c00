"""Request arrival times, as `vllm bench serve` draws them.

Gaps are gamma-distributed with shape = burstiness and mean 1 / rate: burstiness 1 is a Poisson process,
< 1 burstier, > 1 more uniform, inf a fixed interval. Then (vLLM's trick) the times are rescaled so the
last arrival lands exactly at n / rate, which keeps throughput stable across seeds. rate = inf: all at 0.
"""
from __future__ import annotations

import math

import numpy as np


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Offsets in seconds from the benchmark start, one per request, non-decreasing."""
    if n <= 0:
        return []
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / request_rate) / times[-1]
    return [float(t) for t in times]
