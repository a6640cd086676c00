"""tokenmill's OpenMP defaults reach the runtime (libgomp prints what it read with OMP_DISPLAY_ENV), a user's
own settings win, and importing torch first is detected."""
import os
import subprocess
import sys

import pytest

from tokenmill.cpu_threads import OPENMP_DEFAULTS


def _openmp_env(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout + out.stderr


@pytest.mark.parametrize("entry", ["import tokenmill", "import tokenmill.engine.core_proc"])
def test_defaults_reach_libgomp(entry):
    shown = _openmp_env(entry)
    for key, value in OPENMP_DEFAULTS.items():
        assert f"{key} = '{value}'" in shown


def test_user_settings_win():
    shown = _openmp_env("import tokenmill", OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown
    assert all(f"{k} = '{v}'" not in shown for k, v in OPENMP_DEFAULTS.items())


def test_torch_imported_first_is_detected():
    shown = _openmp_env("import torch, tokenmill.cpu_threads as c; print('late', c.applied_too_late)")
    assert "late True" in shown


class _FakeMachine:
    """Cumulative (run-queue wait, idle CPU) seconds that a test advances by hand."""

    def __init__(self):
        self.now = self.wait = self.idle = 0.0

    def advance(self, seconds: float, waiting_cores: float, idle_cores: float) -> None:
        self.now += seconds
        self.wait += seconds * waiting_cores
        self.idle += seconds * idle_cores


def test_governor_drops_threads_under_contention_and_restores_them():
    from tokenmill.cpu_threads import ThreadGovernor

    m, calls = _FakeMachine(), []
    gov = ThreadGovernor(2, calls.append, window_s=0.2, hold_s=2.0, read=lambda: (m.wait, m.idle),
                         clock=lambda: m.now)
    m.advance(0.1, waiting_cores=0.9, idle_cores=0.0)
    gov.tick()
    assert calls == []  # a window has not passed yet
    m.advance(0.25, waiting_cores=0.9, idle_cores=0.0)  # a neighbour took a core: our threads wait for it
    gov.tick()
    assert calls == []  # one hot window could be a burst of our own
    m.advance(0.25, waiting_cores=0.0, idle_cores=0.0)
    gov.tick()
    m.advance(0.25, waiting_cores=0.9, idle_cores=0.0)
    gov.tick()
    assert calls == []  # the burst ended: hot windows must follow each other
    m.advance(0.25, waiting_cores=0.9, idle_cores=0.0)
    gov.tick()
    assert calls == [1] and gov.threads == 1
    for _ in range(5):  # one thread, neighbour still there: nothing waits, nothing idles
        m.advance(0.3, waiting_cores=0.0, idle_cores=0.05)
        gov.tick()
    assert calls == [1]
    m.advance(0.3, waiting_cores=0.0, idle_cores=1.0)  # neighbour gone, but within hold_s of the drop
    gov.tick()
    assert calls == [1]
    m.advance(2.0, waiting_cores=0.0, idle_cores=1.0)
    gov.tick()
    assert calls == [1, 2] and gov.threads == 2
    m.advance(0.3, waiting_cores=0.0, idle_cores=1.0)  # never above the starting count
    gov.tick()
    assert calls == [1, 2]


def test_governor_reads_this_machine():
    from tokenmill.cpu_threads import _read_counters

    wait, idle = _read_counters(os.sched_getaffinity(0))
    assert wait >= 0 and idle > 0


def test_thread_changes_mid_generation_keep_greedy_tokens(llama_dir):
    import itertools

    import torch

    from tokenmill import SamplingParams
    from tokenmill.cpu_threads import ThreadGovernor
    from conftest import make_llm, random_prompts

    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 30, 12, 50], seed=11)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # one decode step per engine step (not the offline LLM's bursts): a governor tick, and a change, each step
    plain = make_llm(llama_dir, adaptive_cpu_threads=False, num_scheduler_steps=1)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    llm = make_llm(llama_dir, adaptive_cpu_threads=False, num_scheduler_steps=1)
    # every window alternates: threads all waiting (drop), then cores idle (raise)
    steps = itertools.cycle([(10.0, 0.0), (0.0, 10.0)])
    readings = itertools.accumulate(steps, lambda a, b: (a[0] + b[0], a[1] + b[1]))
    ticks = itertools.count()
    gov = ThreadGovernor(2, torch.set_num_threads, window_s=1.0, hold_s=0.0, patience=1,
                         read=lambda: next(readings), clock=lambda: float(next(ticks)))
    llm.llm_engine.core.governor = gov
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        torch.set_num_threads(2)
    assert gov.num_changes > 10
    assert got == want
