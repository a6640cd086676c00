"""A once-only failure switch for optional GPU kernels: the first error turns them off for the process with one
warning, and the callers take their torch paths from then on instead of failing a step."""
from __future__ import annotations

import logging

logger = logging.getLogger("tokenmill")


class FailureLatch:
    def __init__(self, warning: str):
        self.warning = warning  # %s: the first error
        self.reason: str | None = None

    def __bool__(self) -> bool:
        """True once tripped."""
        return self.reason is not None

    def trip(self, error: Exception) -> None:
        if self.reason is None:
            self.reason = f"{type(error).__name__}: {error}"[:500]
            logger.warning(self.warning, self.reason)
