"""Static batching, the ladder's baseline: requests join only an empty engine, a batch at a time, and the
batch runs until its last request finishes, as servers without iteration-level scheduling do."""
from __future__ import annotations

import time

from tokenmill.sched.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    def __init__(self, *args, batch_wait_s: float = 0.05, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_wait_s = batch_wait_s

    def _may_admit(self) -> bool:
        if self.running or not len(self.waiting):
            return False
        # a partial batch waits (briefly) for more requests to fill it
        oldest = min(r.arrival_time for r in self.waiting.ordered())
        return len(self.waiting) >= self.max_num_seqs or time.time() - oldest >= self.batch_wait_s
