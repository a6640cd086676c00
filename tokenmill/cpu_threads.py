"""OpenMP defaults that hold up on shared machines (issue 12; measured in BENCHMARKS.md, "CPU contention").

torch's CPU kernels and ours run on libgomp. By default a libgomp thread that reaches the end of a
parallel region spins (~300,000 iterations) before it sleeps. When another process takes one of the
cores, every region then waits for the thread that lost its core while its partner burns the other one,
and a decode step of many small regions slows down 20-60x. A short spin keeps the idle machine's
back-to-back regions hot and lets a waiting thread give its core up under contention.

These apply only where the user set none of them, and only before the OpenMP runtime loads (it reads
its environment once, when torch is imported): `import tokenmill` does it first thing, and so do the
engine-core process and the CLI, which import tokenmill before torch.
"""
from __future__ import annotations

import os
import sys

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}
_USER_KNOBS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# True when torch was imported before tokenmill, so libgomp had read its settings already
applied_too_late = False


def apply_openmp_defaults() -> None:
    global applied_too_late
    if any(k in os.environ for k in _USER_KNOBS):
        return  # the user's choice stands
    os.environ.update(OPENMP_DEFAULTS)
    applied_too_late = "torch" in sys.modules
