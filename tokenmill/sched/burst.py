"""How long a burst of decode steps may be when num_scheduler_steps is 0 (automatic).

A burst runs several greedy decode steps in one engine step, so the host's per-step work is paid once per
burst. Its cost is latency: a prompt that arrives during a burst waits for it, and a request that stops on
EOS early in its burst wastes the steps after. So a burst is bounded in time, not in steps: as many steps as
fit in AUTO_BURST_MS at the step time measured on this machine and batch (up to AUTO_BURST_STEPS). A tiny
model whose step is mostly host work gets long bursts; a model whose step takes tens of milliseconds gets
none, and loses nothing by it.
"""
from __future__ import annotations

AUTO_BURST_STEPS = 16
AUTO_BURST_MS = 4.0


class AutoBurst:
    def __init__(self, max_steps: int = AUTO_BURST_STEPS, budget_ms: float = AUTO_BURST_MS):
        self.max_steps, self.budget_s = max_steps, budget_ms / 1e3
        self.step_s: float | None = None  # moving average of one decode step's wall time

    def observe(self, seconds: float, steps: int) -> int:
        """A decode-only engine step of `steps` decode steps took `seconds`: the burst length to use next."""
        per = seconds / steps
        self.step_s = per if self.step_s is None else self.step_s + 0.25 * (per - self.step_s)
        return max(1, min(self.max_steps, int(self.budget_s / self.step_s)))
