"""Shared benchmark helpers: model shapes, a dummy model directory, memory bandwidth, JSON output, kernel builds."""
from __future__ import annotations

import ctypes
import json
import os
import platform
import subprocess
import tempfile
import time

import tokenmill  # noqa: F401  (before torch: its OpenMP settings, else every worker keeps the long spin-wait)
import torch

QWEN25_05B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                  eos_token_id=151645)


def dummy_model_dir(shape: dict = QWEN25_05B, name: str = "qwen2.5-0.5b-dummy") -> str:
    """A config-only model directory; tokenmill builds random weights for it (load_format='dummy'). Its dtype is
    bfloat16, as the published Qwen2.5 checkpoints', so dtype="auto" picks what a user of the real model gets."""
    from transformers import Qwen2Config

    path = os.path.join(tempfile.gettempdir(), "tokenmill-bench", name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        Qwen2Config(**{"torch_dtype": "bfloat16", **shape}).save_pretrained(path)
    return path


def load_kernels_like(source, like: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """The C file `source` built as the engine builds its kernels (ops/native.py: this tree's headers and flags),
    its `tm_` functions typed as in `like` (the engine's own library of the same kernels), to time against it."""
    from tokenmill.ops import native

    lib = ctypes.CDLL(str(native.build([source])))
    for name in dir(like) if like is not None else ():
        if name.startswith("tm_"):
            fn, typed = getattr(lib, name), getattr(like, name)
            fn.argtypes, fn.restype = typed.argtypes, typed.restype
    return lib


def read_bandwidth_gbs(threads: int = 2, gib: float = 1.0, repeats: int = 5) -> float:
    """Best-of-N GB/s of a `threads`-thread sum over a `gib` GiB float32 buffer."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30 // 4), dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    torch.set_num_threads(prev)
    return x.numel() * 4 / best / 1e9


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "git": _git_rev()}


def _git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


def profile_top(fn, calls: int, n: int = 15) -> tuple[float, list]:
    """`fn` run `calls` times under cProfile: the wall seconds, and the top `n` functions by own time as
    ("file:line name", own us per call, cumulative us per call)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(lambda: [fn() for _ in range(calls)])
    seconds = time.perf_counter() - t
    top = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:n]
    return seconds, [(f"{os.path.basename(f)}:{line} {name}", round(tt * 1e6 / calls, 1), round(ct * 1e6 / calls, 1))
                     for (f, line, name), (_, _, tt, ct, _) in top]


def run_job(script: str, job: dict, tree: str | None = None) -> dict:
    """Run `python script --worker JOBFILE` in a fresh process (its own memory, warm caches and threads) and
    return the dict it wrote. The job travels in a file: long prompts are too big for a command line. `tree`:
    another checkout whose tokenmill the process imports (an A/B of two commits)."""
    import sys

    env = None if tree is None else dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as j, tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        json.dump({**job, "result": f.name}, j)
        j.flush()
        subprocess.run([sys.executable, os.path.abspath(script), "--worker", j.name], check=True, env=env, cwd=tree)
        return json.load(open(f.name))


def serve_job(job_file: str, fn) -> None:
    """The child side of run_job: read the job, run fn(job), write its result where the job says."""
    with open(job_file) as f:
        job = json.load(f)
    res = fn(job)
    with open(job["result"], "w") as f:
        json.dump(res, f)


def qwen_shape_with_shipped_tokenizer() -> str:
    """Qwen2.5-0.5B's layers (dummy weights) with the shipped tokenizer's 4096-token vocabulary, so text
    streams and detokenizes as it would for a real model whose engine step, not the API, dominates."""
    import shutil

    from tokenmill.config import DEFAULT_MODEL

    shape = dict(QWEN25_05B, vocab_size=4096, bos_token_id=None, eos_token_id=None)
    path = dummy_model_dir(shape, "qwen2.5-0.5b-layers-vocab4096")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEFAULT_MODEL, f), path)
    return path
