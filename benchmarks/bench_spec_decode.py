"""Speculative decoding against speculation off, in the same run.

Workloads (each engine configuration in its own process):
  draft   the shipped tiny-shakespeare with tiny-shakespeare-draft, batch 1, prompts from held-out
          Shakespeare (assets/eval/shakespeare_valid.txt), sampled continuation is greedy
  ngram   the shipped model, batch 1, the long-document quoting workload: documents of ~7K tokens of
          held-out plays, each followed by a blank line and the opening words of one of its speeches, so
          the continuation quotes the document (several quotes per document, as questions about one
          document would; its KV is reused through the prefix cache)
  sweep   concurrency 1 .. 32 (max_num_seqs, all requests queued at once; 8 x concurrency requests, at
          least 32, of 128 tokens each, or 128 +- 25 % with --sweep-output-jitter 0.25): off, fixed k,
          adaptive; each timed run after one warm-up request (cold), or with --sweep-warmup wave after a wave
          of `concurrency` requests (steady state). With equal lengths and no drafts, requests admitted
          together finish together, so speculation off prefills each wave of prompts in one step; any
          drafting breaks that lockstep for good (BENCHMARKS.md, "Adaptive depth ... session 17")
  qwen    the Qwen2.5-0.5B shape with dummy weights, repetitive prompts (n-gram), batch 1: what
          verification costs at a realistic size
  idle    (not in the default set) each request alone on an idle engine, prefix caching off: TTFT and TPOT
          against speculation off, for the quoting workload (n-gram, ~7K-token prompts) and held-out
          Shakespeare (draft model); paired in one process. What speculation does to a long prompt's TTFT
          without the queueing that the batch-1 workloads (all requests queued at once) fold into it

    python benchmarks/bench_spec_decode.py [--only draft,ngram,sweep,qwen,idle] [--sweep-warmup one|wave]
        [--sweep-configs off,adaptive] [--sweep-output-jitter 0.25] [--sweep-method draft_model|ngram]
        [--sweep-concurrency 1 4 16 32] [--sweep-paired] [--num-scheduler-steps 0] [--repeats N]
        [--out benchmarks/results/spec_decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN25_05B, dummy_model_dir, machine, run_job, serve_job, write_json  # noqa: E402

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tokenmill", "assets")
MODEL = os.path.join(ASSETS, "models", "tiny-shakespeare")
DRAFT = os.path.join(ASSETS, "models", "tiny-shakespeare-draft")
DOC_CHARS = 20_000  # ~7K tokens of the shipped tokenizer: with the cue and 256 new tokens, inside 8192
QUOTES_PER_DOC = 3
KEEP = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms",
        "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms", "duration", "spec_decode")


def proposer_config(method: str, k: int) -> dict:
    """The speculative_config of the benchmarks' two proposers: the shipped draft model, or prompt lookup."""
    if method == "draft_model":
        return {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": k}
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def _passages(n: int, chars: int, seed: int = 0) -> list[str]:
    text = open(os.path.join(ASSETS, "eval", "shakespeare_valid.txt")).read()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        i = rng.randrange(0, len(text) - chars)
        i = text.index("\n\n", i) + 2  # start at a speech
        out.append(text[i:i + chars])
    return out


def _requests(kind: str, n: int, output_len: int, jitter: float = 0.0) -> list[dict]:
    if kind == "draft":  # output lengths uniform in output_len * (1 +- jitter), seeded
        rng = random.Random(4)
        return [{"prompt": p, "output_len": round(output_len * (1 + rng.uniform(-jitter, jitter)))}
                for p in _passages(n, 300, seed=1)]
    if kind == "quote":  # n documents x QUOTES_PER_DOC cues
        rng = random.Random(2)
        reqs = []
        for doc in _passages(n, DOC_CHARS, seed=2):
            speeches = [i + 2 for i in range(len(doc) - 2000) if doc.startswith("\n\n", i)]
            for start in rng.sample(speeches, QUOTES_PER_DOC):
                cue = doc[start:doc.index("\n", doc.index("\n", start) + 1) + 1]  # speaker line + first line
                reqs.append({"prompt": doc + "\n\n" + cue, "output_len": output_len})
        return reqs
    if kind == "repeat":  # token ids for the dummy Qwen shape: a random phrase, repeated
        rng = random.Random(3)
        out = []
        for _ in range(n):
            phrase = [rng.randrange(100, 150000) for _ in range(24)]
            out.append({"prompt": {"prompt_token_ids": phrase * 10}, "output_len": output_len})
        return out
    raise ValueError(kind)


def _worker(job: dict) -> dict:
    import tokenmill  # noqa: F401  (before torch: OpenMP settings)
    from tokenmill.bench.datasets import SampleRequest
    from tokenmill.bench.offline import build_engine, run_offline

    reqs = [SampleRequest(r["prompt"], 0, r["output_len"]) for r in job["requests"]]

    def run(engine, warmups):
        res = run_offline(reqs, engine=engine, request_rate=float("inf"), seed=0, ignore_eos=True,
                          disable_tqdm=True, sampling={"temperature": 0.0}, num_warmups=warmups)
        return {k: res.get(k) for k in KEEP}

    def alone(engine, warmups):
        # each request on its own: no queue ahead of it, so its TTFT is its own prefill and first token
        per = [run_offline([req], engine=engine, ignore_eos=True, disable_tqdm=True, sampling={"temperature": 0.0},
                           num_warmups=warmups if i == 0 else 0) for i, req in enumerate(reqs)]
        return {"ttft_ms": [r["median_ttft_ms"] for r in per], "tpot_ms": [r["median_tpot_ms"] for r in per]}

    if "engines" not in job:
        return run(build_engine(job["engine"]), job.get("warmups", 1))
    if job.get("alone"):
        run = alone
    # paired: every configuration's engine in this one process, the workload run through each in turn, the order
    # reversed every other round (ABBA), so that both meet the same minutes of a machine whose speed drifts
    engines = {name: build_engine(kw) for name, kw in job["engines"].items()}
    rounds = []
    for r in range(job["rounds"]):
        names = list(engines) if r % 2 == 0 else list(engines)[::-1]
        rounds.append({name: run(engines[name], job.get("warmups", 1) if r == 0 else 0) for name in names})
    return {"rounds": rounds}


def _run(label: str, engine: dict, requests: list[dict], warmups: int = 1) -> dict:
    res = run_job(__file__, {"engine": engine, "requests": requests, "warmups": warmups})
    spec = res.get("spec_decode") or {}
    print(f"  {label:<36} {res['output_throughput']:8.1f} tok/s  TPOT {res['median_tpot_ms']:7.2f} ms  "
          f"TTFT {res['median_ttft_ms']:8.1f} ms  accept {spec.get('acceptance_rate', 0):.2f}  "
          f"len {spec.get('mean_acceptance_length', 0):.2f}", flush=True)
    return res


def _ab(label: str, base: dict, specs: dict[str, dict | None], requests: list[dict], repeats: int,
        warmups: int = 1) -> dict:
    """Each configuration `repeats` times, interleaved; ratios are against 'off' of the same round."""
    runs: dict[str, list[dict]] = {name: [] for name in specs}
    for _ in range(repeats):
        for name, spec in specs.items():
            engine = dict(base, **({"speculative_config": spec} if spec else {}))
            runs[name].append(_run(f"{label}: {name}", engine, requests, warmups))
    ratios = {}
    for name in specs:
        if name == "off":
            continue
        r = [s["output_throughput"] / o["output_throughput"] for s, o in zip(runs[name], runs["off"])]
        t = [s["median_tpot_ms"] / o["median_tpot_ms"] for s, o in zip(runs[name], runs["off"])]
        f = [s["median_ttft_ms"] / o["median_ttft_ms"] for s, o in zip(runs[name], runs["off"])]
        ratios[name] = {"output_tok_s_vs_off": r, "median_tpot_vs_off": t, "median_ttft_vs_off": f,
                        "mean_output_tok_s_vs_off": sum(r) / len(r), "median_output_tok_s_vs_off": statistics.median(r)}
    return {"runs": runs, "ratios": ratios}


def _paired(label: str, base: dict, specs: dict[str, dict | None], requests: list[dict], rounds: int) -> dict:
    """All configurations in one process, alternating (`_worker`), prefix caching off (a round must not hit the
    blocks of the one before). Round 0 starts cold (a fresh engine, one warm-up request); later rounds find each
    engine as the one before left it, its depth choices already learnt: a server some seconds into a load."""
    base = dict(base, enable_prefix_caching=False)
    engines = {name: dict(base, **({"speculative_config": spec} if spec else {})) for name, spec in specs.items()}
    res = run_job(__file__, {"engines": engines, "requests": requests, "rounds": rounds})["rounds"]
    ratios = {}
    for name in specs:
        if name == "off":
            continue
        r = [x[name]["output_throughput"] / x["off"]["output_throughput"] for x in res]
        ratios[name] = {"output_tok_s_vs_off": r, "cold": r[0], "median_output_tok_s_vs_off": statistics.median(r[1:]),
                        "mean_output_tok_s_vs_off": sum(r[1:]) / len(r[1:])}
        print(f"  {label}: {name} / off per round (round 0 cold): {' '.join(f'{x:.3f}' for x in r)}", flush=True)
    return {"runs": res, "ratios": ratios}


def _idle(label: str, base: dict, specs: dict[str, dict | None], requests: list[dict], rounds: int) -> dict:
    """Each request alone on an idle engine (`_worker`'s `alone`), all configurations paired in one process:
    per configuration the median over requests and rounds of its TTFT and TPOT against off's for the same
    request and round."""
    base = dict(base, enable_prefix_caching=False)  # a later round must not find the prompt cached
    engines = {name: dict(base, **({"speculative_config": spec} if spec else {})) for name, spec in specs.items()}
    res = run_job(__file__, {"engines": engines, "requests": requests, "rounds": rounds, "alone": True})["rounds"]
    ratios = {}
    for name in specs:
        if name == "off":
            continue
        ratios[name] = {m: statistics.median(x[name][m][i] / x["off"][m][i] for x in res
                                             for i in range(len(requests)))
                        for m in ("ttft_ms", "tpot_ms")}
        print(f"  {label}: {name} / off, each request alone: median TTFT {ratios[name]['ttft_ms']:.3f}, "
              f"median TPOT {ratios[name]['tpot_ms']:.3f}", flush=True)
    off_ttft = statistics.median(t for x in res for t in x["off"]["ttft_ms"])
    return {"runs": res, "ratios": ratios, "off_median_ttft_ms": off_ttft}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help="(internal) run one configuration from this job file")
    ap.add_argument("--only", default="draft,ngram,sweep,qwen")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sweep-configs", default="off,fixed k,adaptive", help="comma-separated; 'off' is needed")
    ap.add_argument("--sweep-warmup", choices=("wave", "one"), default="one",
                    help="before each timed sweep run: one wave of `concurrency` requests (steady state) or one request (cold)")
    ap.add_argument("--sweep-output-jitter", type=float, default=0.0,
                    help="sweep output lengths uniform in 128 x (1 +- this); 0: all 128 (requests in lockstep)")
    ap.add_argument("--sweep-method", choices=("draft_model", "ngram"), default="draft_model",
                    help="the proposer of the load sweep (held-out Shakespeare: n-gram drafts land only where the "
                         "plays repeat themselves)")
    ap.add_argument("--sweep-concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--sweep-paired", action="store_true",
                    help="the sweep's configurations in one process, alternating ABBA for --repeats rounds (round 0 "
                         "cold, the rest in steady state), instead of one process per run")
    ap.add_argument("--num-scheduler-steps", type=int, default=None,
                    help="every engine's num_scheduler_steps (0: automatic bursts, the offline LLM's default); "
                         "default: the engine's own (1, single steps, as the server runs)")
    ap.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = ap.parse_args()
    if args.worker:
        serve_job(args.worker, _worker)
        return

    k, only, out = args.k, set(args.only.split(",")), {}
    ngram, draft = proposer_config("ngram", k), proposer_config("draft_model", k)
    tiny = dict(model=MODEL, max_model_len=512)
    if args.num_scheduler_steps is not None:
        tiny["num_scheduler_steps"] = args.num_scheduler_steps
    if "draft" in only:
        print("[spec] draft model, batch 1, held-out Shakespeare", flush=True)
        out["draft_batch1"] = _ab("draft", dict(tiny, max_num_seqs=1),
                                  {"off": None, "fixed k": dict(draft, adaptive=False), "adaptive": draft},
                                  _requests("draft", 8, 128), args.repeats)
    if "ngram" in only:
        print("[spec] n-gram, batch 1, quoting workload", flush=True)
        out["ngram_batch1"] = _ab("ngram", dict(tiny, max_num_seqs=1, max_model_len=8192),
                                  {"off": None, "fixed k": dict(ngram, adaptive=False), "adaptive": ngram},
                                  _requests("quote", 4, 256), args.repeats)
    if "sweep" in only:
        out["sweep"] = {}
        for conc in args.sweep_concurrency:
            print(f"[spec] load sweep, concurrency {conc}", flush=True)
            # warm-up: one wave of `conc` requests at once (--sweep-warmup wave: every configuration starts
            # the timed run in steady state, its depth choices for this load already tried, as a serving
            # process is after its first seconds at a load) or a single request (cold: the first tries of
            # each depth at this load fall inside the timed run)
            warmups = conc if args.sweep_warmup == "wave" else 1
            proposer = draft if args.sweep_method == "draft_model" else ngram
            configs = {"off": None, "fixed k": dict(proposer, adaptive=False), "adaptive": proposer}
            configs = {name: spec for name, spec in configs.items() if name in args.sweep_configs.split(",")}
            reqs = _requests("draft", max(32, 8 * conc), 128, args.sweep_output_jitter)
            if args.sweep_paired:
                out["sweep"][conc] = _paired(f"c={conc}", dict(tiny, max_num_seqs=conc), configs, reqs,
                                             1 + args.repeats)
            else:
                out["sweep"][conc] = _ab(f"c={conc}", dict(tiny, max_num_seqs=conc), configs, reqs, args.repeats,
                                         warmups)
    if "idle" in only:
        print("[spec] each request alone on an idle engine: TTFT and TPOT", flush=True)
        out["idle"] = {
            "ngram quoting": _idle("ngram quoting", dict(tiny, max_num_seqs=1, max_model_len=8192),
                                   {"off": None, "adaptive": ngram}, _requests("quote", 2, 64), args.repeats),
            "draft held-out": _idle("draft held-out", dict(tiny, max_num_seqs=1),
                                    {"off": None, "adaptive": draft}, _requests("draft", 8, 64), args.repeats)}
    if "qwen" in only:
        print("[spec] Qwen2.5-0.5B shape, n-gram, batch 1", flush=True)
        qwen = dict(model=dummy_model_dir(QWEN25_05B), load_format="dummy", dtype="bfloat16", max_model_len=1024,
                    max_num_seqs=1)
        out["qwen_ngram_batch1"] = _ab("qwen", qwen, {"off": None, "fixed k": dict(ngram, adaptive=False),
                                                      "adaptive": ngram}, _requests("repeat", 3, 64), args.repeats)
    summary = {}
    for name, block in out.items():
        if name == "idle":
            for label, b in block.items():
                for cfg, r in b["ratios"].items():
                    summary[f"idle {label} {cfg}: median TTFT vs off"] = r["ttft_ms"]
                    summary[f"idle {label} {cfg}: median TPOT vs off"] = r["tpot_ms"]
        elif name == "sweep":
            for conc, b in block.items():
                for cfg, r in b["ratios"].items():
                    summary[f"sweep c={conc} {cfg}: output tok/s vs off"] = r["mean_output_tok_s_vs_off"]
                    summary[f"sweep c={conc} {cfg}: median of rounds"] = r["median_output_tok_s_vs_off"]
                    summary[f"sweep c={conc} {cfg}: rounds"] = [round(x, 3) for x in r["output_tok_s_vs_off"]]
        else:
            for cfg, r in block["ratios"].items():
                summary[f"{name} {cfg}: output tok/s vs off"] = r["mean_output_tok_s_vs_off"]
                summary[f"{name} {cfg}: median TPOT vs off"] = sum(r["median_tpot_vs_off"]) / len(r["median_tpot_vs_off"])
                summary[f"{name} {cfg}: median TTFT vs off"] = sum(r["median_ttft_vs_off"]) / len(r["median_ttft_vs_off"])
    print(json.dumps(summary, indent=2))
    write_json({"machine": machine(), "args": vars(args), "summary": summary, "results": out}, args.out)


if __name__ == "__main__":
    main()
