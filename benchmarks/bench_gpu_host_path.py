"""The GPU path's host work per decode step, measured on a CPU (issue 15: <= 0.3 ms at batch 1).

On a GPU, a decode step's host work is: schedule, prepare the inputs, copy them into the CUDA graph's
buffers, replay, launch the LM head and the sampler, start the tokens' copy back, collect the step before
(async scheduling), update the requests and process the outputs. Only the replay and the kernels are device
work; the rest is the same Python on any host. So this runs the engine the way it runs on a GPU (async
scheduling, the decode-graph buffers and bucket replay, the device sampler, no CPU one-call step) with the
model's math replaced by zeros, and reports per decode step:

- host_ms: the step's wall time (everything above; the LM head returns constant logits, 64 wide);
- torch_ops: aten ops dispatched per step, each of which is at least one kernel launch (5-10 us of host
  time with CUDA) or a copy on a GPU, and which this CPU run does not price;
- the top functions by own time at batch 1 (cProfile).

    python benchmarks/bench_gpu_host_path.py --out benchmarks/results/gpu_host_path.json
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import profile_top  # noqa: E402


def build_llm(max_num_seqs: int, max_model_len: int = 512):
    """The shipped model's engine, switched to the GPU path's host code with zero-cost device work."""
    import torch

    from tokenmill import LLM
    from tokenmill.worker.cuda_graphs import DecodeGraphs
    llm = LLM(dtype="float32", max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=True,
              async_scheduling=True)
    core = llm.llm_engine.core
    runner = core.runner
    model = runner.model
    hidden_size = core.model_config.hidden_size
    zeros = torch.zeros(max(core.config.max_num_batched_tokens, max_num_seqs), hidden_size)
    model.forward = lambda input_ids, *a, **k: zeros[:input_ids.shape[0]]  # prefill steps: no math
    # 64 columns, not the vocabulary: the argmax over them is a kernel on a GPU, and near free here
    logits = torch.zeros(zeros.shape[0], 64)
    logits[:, 7] = 1.0  # argmax: token 7
    model.compute_logits = lambda hidden: logits[:hidden.shape[0]]  # the LM head: a launch on a GPU
    graphs = DecodeGraphs(model, runner.backend, runner.kv_caches, max_num_seqs, max_model_len, runner.block_size,
                          "cpu", capture=False)
    graphs.use_graphs = True  # "replay" each bucket: a no-op whose output is zeros, as a captured graph's buffer
    for size in graphs.sizes:
        graphs.graphs[size] = types.SimpleNamespace(replay=lambda: None)
        graphs.outputs[size] = zeros[:size]
    runner.decode_step = graphs
    return llm


class OpCounter:
    """aten ops dispatched while active (one per kernel launch or copy on a GPU)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counts = self.counts = collections.Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                counts[str(func.overloadpacket.__name__)] += 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def time_prepare(engine) -> float:
    """Microseconds to prepare one decode step of every running request into the graphs' buffers (the runner's
    `prepare_batch`, the part of a step that grows with the block tables): best of 7 x 200 calls, less noisy
    than whole steps on a shared machine."""
    import timeit

    import torch

    from tokenmill.sched.output import ScheduledRequest
    runner = engine.core.runner
    seqs = [ScheduledRequest(r.request_id, r.num_tokens - 1, 1, [], 1) for r in engine.core.scheduler.running]
    if not seqs:  # (a short warm-up run has finished by now)
        return 0.0
    states = [runner.requests[s.request_id] for s in seqs]
    with torch.inference_mode():
        best = min(timeit.repeat(lambda: runner.prepare_batch(seqs, states, runner.decode_step), number=200,
                                 repeat=7))
    return round(best / 200 * 1e6, 2)


def run_batch(llm, batch: int, new_tokens: int, profile: bool = False, prompt_len: int = 32) -> dict:
    from tokenmill import SamplingParams
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, {"prompt_token_ids": [10 + (i + j) % 40 for j in range(prompt_len)]}, sp)
    sched = engine.core.scheduler
    while sched.waiting or any(r.num_output_tokens < 4 for r in sched.running):  # prefills, first decodes
        engine.step(final_only=True)
    times = []
    for _ in range(new_tokens // 2):
        t = time.perf_counter()
        engine.step(final_only=True)
        times.append(time.perf_counter() - t)
    with OpCounter() as ops:
        for _ in range(10):
            engine.step(final_only=True)
    prepare_us = time_prepare(engine)
    res = {"batch": batch, "steps": len(times), "host_ms": round(statistics.median(times) * 1e3, 4),
           "host_ms_p10": round(sorted(times)[len(times) // 10] * 1e3, 4),
           "torch_ops": round(sum(ops.counts.values()) / 10, 1), "prepare_us": prepare_us,
           "ops": {k: v / 10 for k, v in ops.counts.most_common()}}
    if profile:
        _, res["top_us_per_step"] = profile_top(lambda: engine.step(final_only=True), 20, n=20)
    while engine.has_unfinished_requests():
        engine.step(final_only=True)
    return res


def main() -> None:
    from common import machine, write_json
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    # long prompts make each row's block table long (prompt_len / block_size entries, copied every step)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out", default="benchmarks/results/gpu_host_path.json")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    max_model_len = max(512, args.prompt_len + args.new_tokens + 16)
    llm = build_llm(max(batches), max_model_len)
    run_batch(llm, 1, 16)  # warm-up
    runs = {b: [run_batch(llm, b, args.new_tokens, profile=(r == 0), prompt_len=args.prompt_len)
                for r in range(args.reps)]
            for b in batches}
    best = {b: min(rs, key=lambda x: x["host_ms"]) for b, rs in runs.items()}
    for b, rs in runs.items():  # the first run of each batch size is the profiled one
        best[b]["top_us_per_step"] = rs[0]["top_us_per_step"]
    res = {"machine": machine(), "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "by_batch": best,
           "host_ms_runs": {b: [r["host_ms"] for r in rs] for b, rs in runs.items()}}
    write_json(res, args.out)
    for b, r in best.items():
        print(f"batch {b:3d}: host {r['host_ms']:.3f} ms per decode step (runs {res['host_ms_runs'][b]}), "
              f"{r['torch_ops']:.0f} torch ops, prepare {r['prepare_us']:.1f} us")
        print("   ops:", ", ".join(f"{k} {v:g}" for k, v in list(r["ops"].items())[:12]))
        for name, own, cum in r.get("top_us_per_step", []):
            print(f"  {own:7.1f} {cum:7.1f} us  {name}")


if __name__ == "__main__":
    main()
