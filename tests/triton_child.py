"""Running Triton kernel cases in a child process, for the kernel test files (test_triton_*.py).

Triton picks interpreter mode when its JIT decorates a kernel, from TRITON_INTERPRET, so kernel cases run
in a child (the test file run as a script) with TRITON_INTERPRET=1 set before anything imports triton; the
pytest process may already have imported the kernels in compiled mode. The child prints one JSON record per
case, and each case is its own test in the parent. A second child, with TRITON_INTERPRET unset, compiles
kernels for an sm_90 target down to a cubin (no GPU needed): that catches what only Triton's compiler checks
(tl.dot shapes, layouts, dtype rules), which the interpreter never runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

import tokenmill

try:
    import triton
    HAVE_TRITON = True
except ImportError:
    triton = None
    HAVE_TRITON = False

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install 'tokenmill[test]')")
TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


SHARD_ENV = "TOKENMILL_TEST_SHARD"  # "i/n": the child runs every n-th job from the i-th


def child_main(jobs: dict[str, Callable[[], dict]]) -> None:
    """In the child: run every job of its shard, print their records (an exception is a record too) on one
    line."""
    import torch
    torch.set_num_threads(1)
    shard, shards = map(int, os.environ.get(SHARD_ENV, "0/1").split("/"))
    results = {}
    for case_id, job in list(jobs.items())[shard::shards]:
        try:
            results[case_id] = job()
        except Exception as e:  # reported per case by the parent
            results[case_id] = {"exception": f"{type(e).__name__}: {e}"[-3000:]}
    print("RESULTS " + json.dumps(results))


def run_child(test_file: str, mode: str, timeout: float = 300, extra_args: list[str] = ()) -> dict:
    """In the parent: run `test_file` as a script with arguments `mode` ("interpret" sets TRITON_INTERPRET=1)
    and `extra_args`, with this tokenmill and tests/ first on the path; returns the children's records. The jobs
    are split over one single-threaded child per core (up to 2): the interpreter is single-threaded, and
    these children are most of the suite's time on a 2-core machine."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tokenmill.__file__).parents[1]), str(Path(__file__).parent),
                                         env.get("PYTHONPATH", "")])
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    shards = max(1, min(2, len(os.sched_getaffinity(0))))
    procs = [subprocess.Popen([sys.executable, test_file, mode, *extra_args], env={**env, SHARD_ENV: f"{i}/{shards}"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(shards)]
    results = {}
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULTS ")]
            assert proc.returncode == 0 and lines, f"{mode} child failed:\n{out[-3000:]}\n{err[-3000:]}"
            results.update(json.loads(lines[-1].removeprefix("RESULTS ")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def skip_without_nvidia_backend() -> None:
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend to compile for")


def compile_for_sm90(kernel, signature: dict, constexprs: dict, num_warps: int = 4) -> int:
    """Compile `kernel` for an H100/H200 (sm_90) without a GPU (ptxas ships with triton); cubin size in bytes.
    `signature` maps every argument to a Triton type ("*fp16", "i32", ...) or "constexpr"."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    return len(compiled.asm["cubin"])


def kernel_fixtures(test_file: str):
    """A kernel test file's two module fixtures: `interpreted` (its cases' records under the interpreter) and
    `compiled` (its sm_90 compiles). Use: `interpreted, compiled = kernel_fixtures(__file__)`."""
    @pytest.fixture(scope="module")
    def interpreted() -> dict:
        return run_child(test_file, "interpret")

    @pytest.fixture(scope="module")
    def compiled() -> dict:
        skip_without_nvidia_backend()
        return run_child(test_file, "compile")

    return interpreted, compiled


def assert_near_twin(err: float, mutant_err: dict[str, float], tol: float, margin: float = 10) -> None:
    """A kernel case's verdict: within `tol` of its twin, and every mutant twin at least `margin` x tol away
    (else the case could not have caught that bug)."""
    assert err <= tol, f"max error {err:.2e} (relative to max |out|) over {tol:.0e}"
    for mutant, e in mutant_err.items():
        assert e > margin * tol, f"mutant {mutant} is within {e:.2e}: weak case"


def assert_compiled(r: dict) -> None:
    """A compile case's verdict: Triton's compiler, which the interpreter skips (dot shapes, layouts, casts),
    got the kernel down to a cubin."""
    assert "exception" not in r, r.get("exception")
    assert r["cubin_bytes"] > 0


def run_jobs(mode: str, interpret_jobs: dict, compile_jobs: dict) -> None:
    """The child's entry point: the interpreter cases or the compile cases, by `mode`."""
    child_main(interpret_jobs if mode == "interpret" else compile_jobs)


def stdout_without_triton(code: str) -> str:
    """Run `code` where `import triton` fails (as on a CPU install without it); its stdout, asserting exit 0."""
    env = dict(os.environ, PYTHONPATH=str(Path(tokenmill.__file__).parents[1]))
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['triton'] = None\n" + code], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()
