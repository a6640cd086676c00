"""How the engine holds up when another process takes a core (issue 12, item 6).

OpenMP threads that spin at barriers collapse when a core is taken: every parallel region waits for the
thread that lost its core. For each threading setting, this script times the same work on a quiet machine
and while one busy process (a Python spin loop, unpinned) competes, each setting in fresh processes
(OpenMP reads its environment once, at start):

  latency      one greedy request, 480 new tokens, shipped model, offline engine        (idle, contended)
  served       the same request streamed through `tokenmill serve` (engine core + API)  (idle, contended)
  throughput   32 requests x 128 new tokens, shipped model, offline                     (idle)
  qwen         batch-1 decode, 64 new tokens, Qwen2.5-0.5B shape (dummy weights)        (idle, contended)

    python benchmarks/bench_contention.py --out benchmarks/results/contention.json

Settings are environment overrides; "tokenmill default" is what tokenmill does with nothing set
(tokenmill/cpu_threads.py). Idle throughput is compared with libgomp's own default. A contended run that
exceeds --timeout is recorded as a lower bound.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

SETTINGS = {
    # libgomp's own default (what the engine did before tokenmill set one): spin 300,000 iterations, then sleep
    "libgomp default (GOMP_SPINCOUNT=300000)": {"GOMP_SPINCOUNT": "300000"},
    "spin forever (OMP_WAIT_POLICY=ACTIVE)": {"OMP_WAIT_POLICY": "ACTIVE"},
    "sleep at once (OMP_WAIT_POLICY=PASSIVE)": {"OMP_WAIT_POLICY": "PASSIVE"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
    "GOMP_SPINCOUNT=30000": {"GOMP_SPINCOUNT": "30000"},
    "tokenmill default": {},  # cpu_threads.OPENMP_DEFAULTS
    "1 thread": {"OMP_NUM_THREADS": "1"},
}

SPINNER = "while True: pass"


def _child_env(overrides: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "TOKENMILL_OMP"))}
    env.update(overrides)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_child(kind: str, overrides: dict, timeout: float) -> dict:
    """One measurement in a fresh process group; on timeout the whole group goes (a served child's server too)."""
    cmd = [sys.executable, __file__, "--child", kind]
    proc = subprocess.Popen(cmd, env=_child_env(overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"timed_out": True, "seconds": timeout}
    if proc.returncode != 0:
        raise RuntimeError(f"child {kind} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


class Spinner:
    """One busy process competing for the CPUs, as a neighbour on a shared machine would."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", SPINNER])
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


# -- children: each runs in a fresh process with the setting's environment --------------------------------------
def _llm(**kw):
    from tokenmill import LLM

    return LLM(**{"dtype": "float32", "max_model_len": 512, "max_num_seqs": 32, **kw})


def _timed_generate(llm, prompts, max_tokens: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return dt


def child_latency() -> dict:
    return {"seconds": _timed_generate(_llm(), ["ROMEO:"], 480)}


def child_throughput() -> dict:
    prompts = [f"{name}:" for name in ("ROMEO", "JULIET", "HAMLET", "LEAR")] * 8
    dt = _timed_generate(_llm(), prompts, 128)
    return {"seconds": dt, "output_tok_s": 32 * 128 / dt}


def child_qwen() -> dict:
    from common import dummy_model_dir

    llm = _llm(model=dummy_model_dir(), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    dt = _timed_generate(llm, [{"prompt_token_ids": list(range(100, 228))}], 64)
    return {"seconds": dt, "output_tok_s": 64 / dt}


def child_served() -> dict:
    import httpx
    from served import Served

    with Served() as server:
        body = {"model": "bench", "prompt": "ROMEO:", "temperature": 0, "ignore_eos": True, "stream": True}
        url = server.url + "/v1/completions"
        httpx.post(url, json={**body, "max_tokens": 4, "stream": False}, timeout=60)  # warm-up
        t = time.perf_counter()
        with httpx.stream("POST", url, json={**body, "max_tokens": 480}, timeout=None) as r:
            for _ in r.iter_lines():
                pass
        return {"seconds": time.perf_counter() - t}


CHILDREN = {"latency": child_latency, "throughput": child_throughput, "qwen": child_qwen, "served": child_served}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=list(CHILDREN))
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), help="names from SETTINGS")
    ap.add_argument("--kinds", nargs="+", default=["latency", "served", "throughput", "qwen"])
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per contended run before giving up")
    ap.add_argument("--idle-only", action="store_true", help="skip the contended runs (idle A/B of settings)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the settings, alternating, this many times")
    ap.add_argument("--out", default="benchmarks/results/contention.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child]()))
        return
    from common import machine, write_json

    result = {"machine": machine(), "spinner": SPINNER, "runs": {}}
    for name, rnd in ((n, r) for r in range(args.rounds) for n in args.settings):
        env = SETTINGS[name]
        for kind in args.kinds:
            entry = {"idle": run_child(kind, env, args.timeout * 4)}
            if kind != "throughput" and not args.idle_only:
                with Spinner():
                    entry["contended"] = run_child(kind, env, args.timeout)
                entry["slowdown"] = entry["contended"]["seconds"] / entry["idle"]["seconds"]
                entry["slowdown_is_lower_bound"] = bool(entry["contended"].get("timed_out"))
            result["runs"][f"{name}/{kind}" + (f"/round{rnd + 1}" if args.rounds > 1 else "")] = entry
            print(name, kind, json.dumps(entry), flush=True)
    for key, entry in result["runs"].items():
        base = result["runs"].get("libgomp default (GOMP_SPINCOUNT=300000)/" + key.split("/", 1)[1])
        if base and "output_tok_s" in entry["idle"]:
            entry["idle_vs_libgomp_default"] = entry["idle"]["output_tok_s"] / base["idle"]["output_tok_s"]
    write_json(result, args.out)


if __name__ == "__main__":
    main()
