"""Where a speculative run's time goes, step by step: speculation off, a fixed depth and adaptive, paired.

The load sweep of bench_spec_decode.py gives one ratio per round; this splits each run's wall time by the kind
of step that spent it, so that a ratio can be traced to its cause (what drafting saves on decode steps, what it
adds to the steps that admit prompts):

    prefill   steps that carry a prompt's prefill (with the decodes and verifications batched beside it)
    plain     single decode steps with no drafts
    burst     decode steps run N at a time (no request drafts)
    drafting  decode steps that verify drafts

Each step's time is its whole cycle (its start to the next step's start), as the draft policy measures it.
Same workload as the sweep (held-out Shakespeare, the shipped pair, outputs of 128 x (1 +- jitter) tokens,
8 x concurrency requests queued at once, prefix caching off), all engines in this one process, the order
reversed every other round.

    python benchmarks/bench_spec_steps.py --concurrency 32 --rounds 10 --configs off,k1,adaptive \
        --out benchmarks/results/spec_steps_c32.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import tokenmill  # noqa: F401  (before torch: OpenMP settings)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec_decode import MODEL, _requests, proposer_config  # noqa: E402
from common import machine, write_json  # noqa: E402
from tokenmill.bench.datasets import SampleRequest  # noqa: E402
from tokenmill.bench.offline import build_engine, run_offline  # noqa: E402
from tokenmill.engine.core import EngineCore  # noqa: E402

KINDS = ("prefill", "plain", "burst", "drafting")


class StepLog:
    """Wraps EngineCore.step and _finish_step (for this process) to log every step of the engine being run."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, str, int]] = []  # (start, kind, tokens emitted)
        self.propose_s = 0.0
        step, finish = EngineCore.step, EngineCore._finish_step
        log = self

        def logged_step(core):
            core._log_t0 = time.perf_counter()
            return step(core)

        def logged_finish(core, sched, result):
            prefill = any(s.num_new_tokens > s.num_sampled_positions for s in sched.seqs)
            drafts = any(s.num_sampled_positions > 1 for s in sched.seqs)
            kind = "prefill" if prefill else "burst" if sched.burst_steps > 1 else "drafting" if drafts else "plain"
            log.steps.append((core._log_t0, kind, sum(len(t) for t in result.sampled_token_ids.values())))
            log.propose_s += result.propose_seconds
            return finish(core, sched, result)

        EngineCore.step, EngineCore._finish_step = logged_step, logged_finish

    def take(self) -> dict:
        """Seconds, tokens and steps per kind since the last take (a gap over a second between two steps is not
        a step's cycle: the run's end)."""
        out = {kind: {"seconds": 0.0, "tokens": 0, "steps": 0} for kind in KINDS}
        for (t0, kind, tokens), (t1, _, _) in zip(self.steps, self.steps[1:]):
            if t1 - t0 < 1.0:
                row = out[kind]
                row["seconds"] += t1 - t0
                row["tokens"] += tokens
                row["steps"] += 1
        out["propose_seconds"] = self.propose_s
        self.steps, self.propose_s = [], 0.0
        return out


def spec_config(name: str, k: int, method: str = "draft_model") -> dict | None:
    """off, adaptive (k at most), or k<N>: a fixed depth of N; drafts from the shipped draft model or n-gram."""
    draft = proposer_config(method, k)
    if name == "off":
        return None
    if name == "adaptive":
        return draft
    if name.startswith("k") and name[1:].isdigit():
        return dict(draft, num_speculative_tokens=int(name[1:]), adaptive=False)
    raise ValueError(f"unknown configuration {name!r}: off, adaptive or k<N>")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--configs", default="off,k1,adaptive", help="comma-separated; 'off' is needed")
    ap.add_argument("--k", type=int, default=4, help="adaptive's largest depth")
    ap.add_argument("--method", choices=("draft_model", "ngram"), default="draft_model")
    ap.add_argument("--output-jitter", type=float, default=0.25)
    ap.add_argument("--out", default="benchmarks/results/spec_steps.json")
    args = ap.parse_args()
    names = args.configs.split(",")
    assert "off" in names, "ratios are against 'off'"
    log = StepLog()
    base = dict(model=MODEL, max_model_len=512, max_num_seqs=args.concurrency, num_scheduler_steps=0,
                enable_prefix_caching=False)
    engines = {}
    for name in names:
        spec = spec_config(name, args.k, args.method)
        engines[name] = build_engine(dict(base, **({"speculative_config": spec} if spec else {})))
    reqs = [SampleRequest(r["prompt"], 0, r["output_len"])
            for r in _requests("draft", max(32, 8 * args.concurrency), 128, args.output_jitter)]

    def run(engine, warmups=0):
        res = run_offline(reqs, engine=engine, request_rate=float("inf"), seed=0, ignore_eos=True,
                          disable_tqdm=True, sampling={"temperature": 0.0}, num_warmups=warmups)
        return {"output_throughput": res["output_throughput"], "duration": res["duration"], "steps": log.take()}

    for engine in engines.values():
        run(engine, warmups=1)
    rounds = []
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        rounds.append({name: run(engines[name]) for name in order})
        line = " | ".join(f"{n} {rounds[-1][n]['output_throughput'] / rounds[-1]['off']['output_throughput']:.3f} "
                          + " ".join(f"{k} {rounds[-1][n]['steps'][k]['seconds']:.2f}s" for k in KINDS)
                          for n in names)
        print(f"round {r}: {line}", flush=True)
    summary = {}
    for name in names:
        ratio = [x[name]["output_throughput"] / x["off"]["output_throughput"] for x in rounds]
        kinds = {}
        for kind in KINDS:
            sec = [x[name]["steps"][kind]["seconds"] / x["off"]["duration"] for x in rounds]
            tok = [x[name]["steps"][kind]["tokens"] for x in rounds]
            kinds[kind] = {"median_seconds_share_of_off_run": statistics.median(sec),
                           "median_tokens": statistics.median(tok)}
        summary[name] = {"median_output_tok_s_vs_off": statistics.median(ratio), "by_kind": kinds}
        print(f"{name}: median {summary[name]['median_output_tok_s_vs_off']:.3f} of off; seconds per kind as a "
              "share of off's run: " + ", ".join(f"{k} {v['median_seconds_share_of_off_run']:.3f} "
                                                 f"({v['median_tokens']:.0f} tok)" for k, v in kinds.items()))
    write_json({"machine": machine(), "args": vars(args), "summary": summary, "rounds": rounds}, args.out)


if __name__ == "__main__":
    main()
