"""`tokenmill bench ladder`: one workload through a sequence of engine configurations, each adding one
optimization, starting from a faithful unoptimized server inside tokenmill itself.

Each rung runs in a fresh process, so peak memory and warm caches do not leak between rungs.
The KV budget is the same for every rung: the contiguous baseline reserves max_model_len per
request in it, so it fits fewer sequences than the paged layout (that is what paging buys).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime

from tokenmill.bench.datasets import Dataset, LongTextDataset, PrefixRepetitionDataset, RandomMMDataset
from tokenmill.bench.report import LADDER_KIND, ladder_rung
from tokenmill.entrypoints.openai.cli_args import positive_int

BASELINE = dict(batching="static", kv_layout="contiguous", attention_impl="eager", cpu_linear_kernel="torch",
                enable_prefix_caching=False)

# (name, what it changes relative to the rung before, engine kwargs it sets); applied cumulatively.
RUNGS = [
    ("baseline", "static batching (a batch fills, runs to completion, then the next starts); contiguous KV "
     "preallocated to max_model_len per request; unfused eager attention; plain F.linear GEMMs", {}),
    ("+ fused attention", "fused attention: SDPA for prefill, grouped-query matmuls for decode, no repeated "
     "KV heads or per-sequence score materialization", dict(attention_impl="fused")),
    ("+ packed GEMM weights", "CPU: weights repacked once into oneDNN's blocked layout "
     "(on GPU this rung is the Triton/cuBLAS kernels)", dict(cpu_linear_kernel="auto")),
    ("+ continuous batching", "iteration-level scheduling: requests join and leave every step, chunked prefill "
     "shares steps with decodes", dict(batching="continuous")),
    ("+ paged KV + prefix caching", "paged KV blocks allocated on demand (no max_model_len reservation), shared "
     "prompt prefixes computed once", dict(kv_layout="paged", enable_prefix_caching=True)),
    ("+ int8 weights", "weight-only INT8 (W8A16, per output channel, made at load time): half the bytes of bf16 per "
     "decode step; AWQ checkpoints from `tokenmill quantize` run the same way with --model",
     dict(quantization="int8")),
    ("+ tiered KV cache", "prefix blocks evicted from the KV pool go to a host-RAM tier and load back on a hit "
     "instead of being recomputed (docs/kv_tiers.md); it pays when the shared prefixes outgrow the pool, e.g. "
     "--num-prefixes 48 --prefix-len 448", dict(kv_host_cache_gb=1.0)),
    ("+ speculative decoding", "prompt-lookup (n-gram) drafts, up to 4 per step, verified in one pass; k adapts to "
     "measured acceptance and step cost and drops to 0 where drafts do not pay (docs/speculative_decoding.md)",
     dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')),
]
PENDING: list[tuple[str, str]] = []


def long_text_rungs(budgets: tuple[int, ...] = (2048, 512), host_cache_gb: float = 2.0,
                    prefill_cap: int | None = None) -> list[tuple[str, str, dict]]:
    """The long-text ladder: the production engine with the long-prompt levers off, then each in turn.
    After the first budget comes the long-prefill cap (`prefill_cap`, default half the budget), one long
    prefill at a time, then the smaller budgets (the cap at most half of each)."""
    rungs = [("baseline", "the production engine (continuous batching, paged KV, fused attention, packed GEMMs) with "
              "chunked prefill and prefix caching off: a step takes whole prompts, so whatever arrives behind a "
              "document waits for all of its prefill", {})]
    first, *smaller = budgets
    cap = prefill_cap or first // 2
    rungs += [
        (f"+ chunked prefill ({first})", f"prompts prefilled {first} tokens per step, sharing each step with decodes "
         "and short prefills", dict(enable_chunked_prefill=True, max_num_batched_tokens=first)),
        (f"+ long-prefill cap ({cap})", f"one prefill takes at most {cap} tokens of a step (long_prefill_token_threshold):"
         " a short prompt behind a document starts in the next step, not after the document's whole prefill",
         dict(long_prefill_token_threshold=cap)),
        ("+ one document at a time", "at most one prompt longer than the cap prefills at once "
         "(max_long_partial_prefills=1): a second document waits, and the short prompts behind it pass, so a burst "
         "of documents leaves room in every step", dict(max_long_partial_prefills=1)),
    ]
    for b in smaller:
        rungs.append((f"chunk budget {b}", f"a smaller per-step token budget, {b} (cap {min(cap, b // 2)}): each step, "
                      "and so each short prompt's wait, is shorter",
                      dict(max_num_batched_tokens=b, long_prefill_token_threshold=min(cap, b // 2))))
    rungs += [
        ("+ prefix caching", "a document's KV blocks are computed once and reused by its later questions",
         dict(enable_prefix_caching=True)),
        ("+ tiered KV cache", f"document blocks evicted from the KV pool go to a {host_cache_gb:g} GiB host-RAM tier "
         "and load back for the document's next question instead of being recomputed", dict(kv_host_cache_gb=host_cache_gb)),
        ("+ speculative decoding", "prompt-lookup (n-gram) drafts, up to 4 per step, k adapting to acceptance and "
         "step cost (documents are rich in n-gram matches)",
         dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')),
    ]
    return rungs


# The multimodal ladder: one image workload (random-mm, some images repeated across requests), the encoder
# levers switched on in turn from an engine that encodes every image again, inline, for every request.
MULTIMODAL_BASELINE = dict(mm_encoder_cache=False, mm_encoder_overlap=False, enable_prefix_caching=False)
MULTIMODAL_RUNGS = [
    ("baseline", "every request's images encoded again even when an earlier request carried the same image (no "
     "encoder cache across requests), inline before the step's forward (no overlap); no prefix caching", {}),
    ("+ encoder cache", "encoder outputs kept across requests, keyed by a hash of the pixels: a repeated image is "
     "encoded once (--mm-num-distinct-images makes repeats)", dict(mm_encoder_cache=True)),
    ("+ encoder overlap", "waiting requests' images encoded in a worker thread while decode steps run, so a new "
     "request's prefill finds its encoder output ready", dict(mm_encoder_overlap=True)),
    ("+ int8 encoder (w8a8)", "the vision tower's linears in int8, weights and activations (W8A8); lossy: its greedy "
     "text may differ from the baseline's, which the rung records", dict(mm_encoder_quantization="w8a8")),
    ("+ image-keyed prefix caching", "KV blocks keyed by the images they hold: a request whose prompt starts with an "
     "image another request carried skips that image's prefill too", dict(enable_prefix_caching=True)),
]


@dataclass(frozen=True)
class Scenario:
    name: str
    baseline: dict  # engine kwargs of rung 0 on top of the user's
    rungs: list  # (name, changes, delta) applied cumulatively
    workload: dict  # default workload; `dataset` turns the workload into a Dataset


SCENARIOS = {
    "playbook": Scenario("playbook", BASELINE, RUNGS, dict(
        dataset="prefix-repetition", num_prompts=64, request_rate=8.0, prefix_len=192, suffix_len=32, num_prefixes=4,
        output_len=64)),
    "long-text": Scenario("long-text", dict(enable_chunked_prefill=False, enable_prefix_caching=False,
                                            max_num_batched_tokens=None), long_text_rungs(), dict(
        dataset="long-text", num_prompts=48, request_rate=1.0, long_doc_len=8192, short_len=256, question_len=32,
        questions_per_doc=4, long_fraction=0.25, output_len=64)),
    "multimodal": Scenario("multimodal", MULTIMODAL_BASELINE, MULTIMODAL_RUNGS, dict(
        dataset="random-mm", num_prompts=16, request_rate=2.0, input_len=64, output_len=32, mm_images_per_request=1,
        mm_image_size="336x336", mm_num_distinct_images=4, mm_video_fraction=0.0, mm_video_frames=8)),
}


def workload_dataset(w: dict) -> Dataset:
    if w["dataset"] == "prefix-repetition":
        return PrefixRepetitionDataset(w["prefix_len"], w["suffix_len"], w["num_prefixes"], w["output_len"])
    if w["dataset"] == "long-text":
        return LongTextDataset(w["long_doc_len"], w["short_len"], w["question_len"], w["questions_per_doc"],
                               w["long_fraction"], w["output_len"])
    if w["dataset"] == "random-mm":
        return RandomMMDataset(w["input_len"], w["output_len"], 0.0, w["mm_images_per_request"], w["mm_image_size"],
                               w["mm_num_distinct_images"], w["mm_video_fraction"], w["mm_video_frames"])
    raise ValueError(f"no ladder workload for dataset {w['dataset']!r}")


def ladder_configs(base: dict, scenario: Scenario | None = None, rungs: list | None = None) -> list[tuple[str, str, dict]]:
    scenario = scenario or SCENARIOS["playbook"]
    cfg = {**base, **scenario.baseline}
    out = []
    for name, changes, delta in rungs or scenario.rungs:
        cfg = {**cfg, **delta}
        out.append((name, changes, dict(cfg)))
    return out


def _run_rung(name: str, engine_kwargs: dict, workload: dict, out_path: str) -> dict:
    """Run one rung in a child process (this module's --rung-worker entry) and read its result."""
    job = {"name": name, "engine_kwargs": engine_kwargs, "workload": workload, "out": out_path}
    proc = subprocess.run([sys.executable, "-m", "tokenmill.bench.ladder", "--rung-worker", json.dumps(job)])
    if proc.returncode:  # the child printed its own error; a second traceback here would say nothing more
        raise SystemExit(f"error: ladder rung {name!r} failed (exit code {proc.returncode}); its output is above")
    with open(out_path) as f:
        return json.load(f)


def _rung_worker(job: dict) -> None:
    from tokenmill.bench.datasets import get_tokenizer, sample_requests
    from tokenmill.bench.offline import run_offline

    w = job["workload"]
    tok = get_tokenizer(job["engine_kwargs"].get("tokenizer") or job["engine_kwargs"]["model"])
    reqs = sample_requests(workload_dataset(w), w["num_prompts"], tok, seed=w["seed"])
    # greedy, so every rung must produce the tokens of rung 0 (run_ladder checks)
    res = run_offline(reqs, job["engine_kwargs"], request_rate=w["request_rate"], seed=w["seed"], ignore_eos=True,
                      sampling={"temperature": 0.0}, disable_tqdm=True)
    res["label"] = job["name"]
    with open(job["out"], "w") as f:
        json.dump(res, f)


def default_kv_blocks(scenario: str, workload: dict, max_model_len: int, max_num_seqs: int, block_size: int = 16) -> int:
    """playbook: max_num_seqs sequences at max_model_len, exactly the contiguous baseline's full batch.
    long-text: two documents' worth plus a full batch of short requests, so that a third document evicts
    an older one from the pool (what the tiered cache is for)."""
    if scenario == "long-text":
        doc = workload["long_doc_len"] + workload["question_len"] + workload["output_len"]
        short = workload["short_len"] + workload["output_len"]
        return math.ceil((2 * doc + max_num_seqs * short) / block_size)
    return max_num_seqs * math.ceil(max_model_len / block_size)


def multimodal_max_model_len(model: str, workload: dict, video_num_frames: int = 4) -> int:
    """Room for the longest random-mm request: its images' placeholder tokens (a video: one image per sampled
    frame), twice its text tokens (random ids decoded to text come back as more tokens) plus the chat template,
    and its output; at most the model's limit."""
    from tokenmill.config import ModelConfig
    from tokenmill.models.loader import load_hf_config

    mc = ModelConfig.from_hf(load_hf_config(model))
    frames = min(video_num_frames, workload["mm_video_frames"]) if workload["mm_video_fraction"] > 0 else 0
    images = max(workload["mm_images_per_request"], frames)
    need = images * mc.mm_tokens_per_image + 2 * workload["input_len"] + 64 + workload["output_len"]
    return min(need, mc.max_position_embeddings)


def _vs_baseline(rung: dict, first: dict) -> None:
    """Throughput ratios against rung 0 (same workload, same run)."""
    def ratio(a, b):
        return a / b if a is not None and b else None

    rung["output_throughput_vs_baseline"] = ratio(rung["output_throughput"], first["output_throughput"])
    if rung.get("multimodal"):
        rung["images_per_s_vs_baseline"] = ratio(rung["multimodal"]["images_per_s"],
                                                 first["multimodal"]["images_per_s"])


def run_ladder(model: str, out: str, scenario: str = "playbook", workload: dict | None = None,
               max_model_len: int | None = 512, max_num_seqs: int = 16, kv_blocks: int | None = None,
               dtype: str = "float32", seed: int = 0, extra_engine_kwargs: dict | None = None,
               rungs: list | None = None) -> dict:
    """Send one workload through the scenario's rungs, each in a fresh process; write and return the ladder."""
    sc = SCENARIOS[scenario]
    unknown = set(workload or {}) - set(sc.workload)
    if unknown:
        raise ValueError(f"the {scenario} ladder has no workload setting {sorted(unknown)}; it takes {sorted(sc.workload)}")
    workload = {**sc.workload, **(workload or {}), "seed": seed}
    if scenario == "long-text" and max_model_len is None:
        max_model_len = workload["long_doc_len"] + workload["question_len"] + workload["output_len"]
    if scenario == "multimodal" and max_model_len is None:
        frames = (extra_engine_kwargs or {}).get("mm_video_num_frames", 4)
        max_model_len = multimodal_max_model_len(model, workload, frames)
    kv_blocks = kv_blocks or default_kv_blocks(scenario, workload, max_model_len, max_num_seqs)
    base = dict(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                num_kv_blocks=kv_blocks, seed=seed, **(extra_engine_kwargs or {}))
    out_rungs = []
    outdir = os.path.dirname(os.path.abspath(out))
    os.makedirs(outdir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(out))[0]
    first = None  # the baseline rung's texts
    for i, (name, changes, cfg) in enumerate(ladder_configs(base, sc, rungs)):
        path = os.path.join(outdir, f"{stem}.rung{i}.json")
        print(f"[ladder] rung {i}: {name}", flush=True)
        res = _run_rung(name, cfg, workload, path)
        rung = ladder_rung(name, changes, res, config=cfg, result_file=os.path.basename(path))
        rung["failed_requests"] = res.get("failed")
        if res.get("multimodal"):
            rung["multimodal"] = res["multimodal"]
        texts = res.get("generated_texts")
        first = texts if i == 0 else first
        rung["same_greedy_text_as_baseline"] = texts == first
        rung["same_greedy_text_by_request"] = [a == b for a, b in zip(texts, first)]
        # quantized rungs may change tokens: recorded, not an error
        rung["lossy"] = bool(cfg.get("quantization") or cfg.get("mm_encoder_quantization"))
        if not rung["same_greedy_text_as_baseline"]:
            print(f"[ladder]   {'note (lossy rung)' if rung['lossy'] else 'WARNING'}: "
                  f"{rung['same_greedy_text_by_request'].count(False)} of {len(texts)} requests "
                  "generated other text than the baseline rung", flush=True)
        _vs_baseline(rung, out_rungs[0] if out_rungs else rung)
        out_rungs.append(rung)
        line = (f"[ladder]   {rung['output_throughput']:.1f} tok/s, P50/P99 TTFT {rung['p50_ttft_ms']:.0f}/"
                f"{rung['p99_ttft_ms']:.0f} ms, P50 TPOT {rung['p50_tpot_ms']:.1f} ms")
        if rung.get("long_short_p99_ttft_ratio") is not None:
            line += f", long/short P99 TTFT {rung['long_short_p99_ttft_ratio']:.2f}x"
        if rung.get("multimodal"):
            mm = rung["multimodal"]
            line += (f", {mm['images_per_s']:.2f} images/s ({rung['images_per_s_vs_baseline']:.2f}x), "
                     f"{mm['images_encoded']} encoded")
        print(line, flush=True)
    ladder = {"kind": LADDER_KIND, "version": 1, "scenario": scenario, "model": model, "device": _device(),
              "date": datetime.now().isoformat(timespec="seconds"), "workload": workload,
              "engine": {k: v for k, v in base.items() if k != "model"}, "rungs": out_rungs,
              "pending": [{"name": n, "why": w} for n, w in PENDING] if scenario == "playbook" else []}
    with open(out, "w") as f:
        json.dump(ladder, f, indent=2)
    print(f"[ladder] wrote {out}")
    return ladder


def _device() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _budgets(text: str) -> tuple[int, ...]:
    try:
        budgets = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        budgets = ()
    if not budgets or min(budgets) < 1:
        raise argparse.ArgumentTypeError(f"must be positive token counts, comma-separated, e.g. 2048,512; got {text!r}")
    return budgets


def add_ladder_parser(sub) -> None:
    from tokenmill.engine.arg_utils import add_engine_args

    p = sub.add_parser("ladder", help="the optimization ladder: one workload, one optimization added per rung")
    p.add_argument("--scenario", default="playbook", choices=sorted(SCENARIOS),
                   help="playbook: shared-prefix chat from an unoptimized baseline; long-text: short prompts mixed "
                        "with 8K-token document questions, the long-prompt levers switched on in turn; multimodal: "
                        "random-mm image requests, the encoder levers switched on in turn")
    w = p.add_argument_group("workload (defaults depend on --scenario)")
    w.add_argument("--num-prompts", type=positive_int)
    w.add_argument("--request-rate", type=float, help="Poisson arrivals per second")
    w.add_argument("--output-len", type=positive_int)
    w.add_argument("--prefix-len", type=int, help="playbook")
    w.add_argument("--suffix-len", type=int, help="playbook")
    w.add_argument("--num-prefixes", type=int, help="playbook")
    w.add_argument("--long-doc-len", type=int, help="long-text: document tokens")
    w.add_argument("--short-len", type=int, help="long-text: short prompt tokens")
    w.add_argument("--question-len", type=int, help="long-text")
    w.add_argument("--questions-per-doc", type=int, help="long-text")
    w.add_argument("--long-fraction", type=float, help="long-text: share of requests that are document questions")
    w.add_argument("--input-len", type=int, help="multimodal: text tokens per request")
    w.add_argument("--mm-images-per-request", type=int, help="multimodal")
    w.add_argument("--mm-image-size", help="multimodal: WIDTHxHEIGHT")
    w.add_argument("--mm-num-distinct-images", type=int, help="multimodal: a pool of K images (0: all distinct)")
    w.add_argument("--mm-video-fraction", type=float, help="multimodal: share of requests carrying a video")
    w.add_argument("--mm-video-frames", type=int, help="multimodal: frames of each video")
    w.add_argument("--chunk-budgets", type=_budgets, default="2048,512",
                   help="long-text: the chunked-prefill token budgets tried in turn (comma-separated)")
    w.add_argument("--prefill-cap", type=positive_int, default=None,
                   help="long-text: the long_prefill_token_threshold rung's cap (default: half the first budget)")
    w.add_argument("--host-cache-gb", type=float, default=2.0, help="long-text: the tiered rung's host-RAM tier")
    w.add_argument("--result-file", default="ladder.json")
    # The rungs set their own flags (batching, kv_layout, attention_impl, cpu_linear_kernel, prefix caching,
    # chunked prefill, ...); every other engine flag applies to all rungs. The KV budget defaults to what
    # the scenario needs (default_kv_blocks). max_model_len: 512 (playbook), the longest request (long-text,
    # multimodal: multimodal_max_model_len).
    add_engine_args(p, dtype="float32", max_model_len=None, max_num_seqs=16)
    p.set_defaults(func=cmd_ladder)


_RUN_LADDER_ARGS = {"model", "dtype", "max_model_len", "max_num_seqs", "num_kv_blocks", "seed"}
_SET_BY_RUNGS = {"batching", "kv_layout", "attention_impl", "cpu_linear_kernel", "enable_prefix_caching", "quantization",
                 "kv_host_cache_gb", "speculative_config", "enable_chunked_prefill", "max_num_batched_tokens",
                 "long_prefill_token_threshold", "max_long_partial_prefills", "mm_encoder_cache", "mm_encoder_overlap",
                 "mm_encoder_quantization"}
_WORKLOAD_ARGS = ("num_prompts", "request_rate", "output_len", "prefix_len", "suffix_len", "num_prefixes",
                  "long_doc_len", "short_len", "question_len", "questions_per_doc", "long_fraction", "input_len",
                  "mm_images_per_request", "mm_image_size", "mm_num_distinct_images", "mm_video_fraction",
                  "mm_video_frames")


def cmd_ladder(args) -> int:
    from tokenmill.bench.checks import check_limit_mm, check_writable
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.models.loader import load_hf_config

    sc = SCENARIOS[args.scenario]
    workload = {k: getattr(args, k) for k in _WORKLOAD_ARGS if getattr(args, k) is not None}
    wrong = set(workload) - set(sc.workload)
    if wrong:
        raise SystemExit(f"error: --{sorted(wrong)[0].replace('_', '-')} is not a setting of the {args.scenario} ladder")
    rungs = None
    if args.scenario == "long-text":
        rungs = long_text_rungs(args.chunk_budgets, args.host_cache_gb, args.prefill_cap)
    max_model_len = args.max_model_len or (512 if args.scenario == "playbook" else None)
    extra = {k: v for k, v in engine_kwargs(args).items() if k not in _SET_BY_RUNGS and k not in _RUN_LADDER_ARGS}
    # checked here, once: each rung's own process would fail on them only after the ladder started
    if not os.path.isdir(args.model):
        raise ValueError(f"--model {args.model}: no such directory (models load from local directories only)")
    load_hf_config(args.model)
    check_limit_mm(args)
    check_writable(args.result_file, "--result-file")
    run_ladder(args.model, args.result_file, args.scenario, workload, max_model_len, args.max_num_seqs,
               args.num_kv_blocks, args.dtype, args.seed, extra, rungs)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rung-worker", required=True)
    try:
        _rung_worker(json.loads(ap.parse_args().rung_worker))
    except (ValueError, OSError) as e:  # a setting the engine refused: one line, as the CLI prints it
        sys.exit(f"error: {e}")
