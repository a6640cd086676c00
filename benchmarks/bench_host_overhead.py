"""Host time per engine step (issue 15): everything a step does besides the model's math, at batch 1 and 64.

Each decode step of `LLMEngine.step` is timed whole, and inside it the model forward (`model.forward`, or
the runner's captured decode step) and the logits (`model.compute_logits`) are timed too; host time =
step - those. That is the scheduler,
the KV manager, input preparation, the sampler, request updates and output processing (detokenizing
included). On a GPU the device work would overlap part of it; on a CPU it adds up. A model this small
(the shipped 5.5M one by default) makes the host's share plain.

    python benchmarks/bench_host_overhead.py --out benchmarks/results/host_overhead.json

Reports per batch size: median step ms, median forward+logits ms, median host ms, and the host share.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def measure(llm, batch: int, new_tokens: int) -> dict:
    from tokenmill import SamplingParams

    runner = llm.llm_engine.core.runner
    model, step = runner.model, runner.decode_step
    spent = [0.0]
    forward, logits = model.forward, model.compute_logits
    step_run = step.run if step is not None else None
    step_greedy = step.greedy if step is not None else None  # greedy steps: decoder, LM head and argmax in C

    def timed(fn):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return run

    model.forward, model.compute_logits = timed(forward), timed(logits)
    if step is not None:  # the captured decode step (one C call on CPU) is model time too
        step.run, step.greedy = timed(step_run), timed(step_greedy)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, "ROMEO:" if i % 2 else "JULIET:", sp)
    steps, model_s = [], []
    try:
        while engine.has_unfinished_requests():
            spent[0] = 0.0
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            model_s.append(spent[0])
    finally:
        model.forward, model.compute_logits = forward, logits
        if step is not None:
            step.run, step.greedy = step_run, step_greedy
    # decode steps only: skip the first (the prefill) and the last few (requests finishing)
    pairs = list(zip(steps, model_s))[2:-2]
    step_ms = statistics.median(s for s, _ in pairs) * 1e3
    model_ms = statistics.median(m for _, m in pairs) * 1e3
    host = statistics.median(s - m for s, m in pairs) * 1e3
    return {"batch": batch, "steps": len(pairs), "step_ms": round(step_ms, 3), "model_ms": round(model_ms, 3),
            "host_ms": round(host, 3), "host_share": round(host / step_ms, 3)}


def main() -> None:
    from common import machine
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="benchmarks/results/host_overhead.json")
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams
    kw = {"model": args.model} if args.model else {}
    llm = LLM(dtype=args.dtype, max_model_len=512, **kw)
    llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    runs = {b: [measure(llm, b, args.new_tokens) for _ in range(args.reps)]
            for b in (int(x) for x in args.batches.split(","))}
    res = {"machine": machine(), "new_tokens": args.new_tokens,
           "by_batch": {b: min(r, key=lambda x: x["host_ms"]) for b, r in runs.items()}, "runs": runs}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for b, r in res["by_batch"].items():
        print(f"batch {b:3d}: step {r['step_ms']:.3f} ms = model {r['model_ms']:.3f} + host {r['host_ms']:.3f} ms "
              f"({r['host_share']:.0%} host)")


if __name__ == "__main__":
    main()
