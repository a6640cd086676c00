"""What structured outputs cost: output tok/s of requests held to a JSON schema against the same requests
unconstrained, each plain request asked for exactly as many tokens as its structured twin made (ignore_eos),
so both runs decode the same number of tokens per request; and against the same requests through the same
sampler path (a no-op logit bias, which like a grammar turns the argmax-only fast paths off). Shipped model, float32, greedy, batch 1 and 32,
alternated for --reps rounds in one process. Also: the schema's compile time (a fresh compiler: no cache),
and the host time of one matcher step (take a token, write the next bitmask), the per-request cost each
step pays.

    python benchmarks/bench_structured_outputs.py --out benchmarks/results/structured_outputs.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

NAMES = ["ROMEO", "JULIET", "MERCUTIO", "TYBALT", "NURSE", "CAPULET", "MONTAGUE", "FRIAR LAURENCE"]
SCHEMA = {"type": "array", "minItems": 1, "maxItems": 6,
          "items": {"type": "object", "additionalProperties": False, "required": ["speaker", "line"],
                    "properties": {"speaker": {"enum": NAMES}, "line": {"type": "string", "maxLength": 60}}}}


def _timed(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [o.outputs[0] for o in outs]


def _round(llm, prompts, structured) -> dict:
    from tokenmill import SamplingParams

    dt_s, outs = _timed(llm, prompts, structured)
    lengths = [len(o.token_ids) for o in outs]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    dt_p, _ = _timed(llm, prompts, plain)
    # the same requests through the same sampler path (a no-op logit bias turns off the argmax-only fast
    # paths, as a grammar does): what the grammar itself costs
    sampled = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias={0: 0.0}) for n in lengths]
    dt_b, _ = _timed(llm, prompts, sampled)
    valid = 0
    for o in outs:
        try:
            json.loads(o.text)
            valid += 1
        except ValueError:
            pass
    tokens = sum(lengths)
    return {"tokens": tokens, "structured_tok_s": tokens / dt_s, "plain_tok_s": tokens / dt_p,
            "sampler_path_tok_s": tokens / dt_b, "ratio": dt_p / dt_s, "ratio_same_path": dt_b / dt_s,
            "valid_json": valid, "finished_stop": sum(o.finish_reason == "stop" for o in outs)}


def _matcher_costs(llm) -> dict:
    from tokenmill.sample.grammar import GrammarCompiler
    from tokenmill.sampling_params import StructuredOutputsParams

    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.core.runner.grammars.vocab_size  # the logits' width
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    compiler = GrammarCompiler(tok, vocab)
    compiler.compile(StructuredOutputsParams(choice=["warm"]))  # the tokenizer's info, once per process
    t = time.perf_counter()
    compiler.compile(spec)
    compile_ms = (time.perf_counter() - t) * 1e3
    text = json.dumps([{"speaker": "ROMEO", "line": "But soft, what light through yonder window breaks"}] * 3)
    ids = tok.encode(text, add_special_tokens=False)
    m = compiler.matcher(spec, [tok.eos_token_id])
    t = time.perf_counter()
    for i in range(len(ids)):
        m.next_bitmask(ids[:i])
    step_us = (time.perf_counter() - t) / len(ids) * 1e6
    return {"compile_ms": compile_ms, "matcher_step_us": step_us, "steps_timed": len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import StructuredOutputsParams

    llm = LLM(dtype="float32", max_model_len=512)
    structured = SamplingParams(temperature=0, max_tokens=256, structured_outputs=StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True))
    llm.generate(["ROMEO:"], structured, use_tqdm=False)  # warm-up: compile, xgrammar's import
    res = {"machine": os.uname().nodename, "cpu_count": os.cpu_count(), "schema": SCHEMA,
           "matcher": _matcher_costs(llm), "batch1": [], "batch32": []}
    prompts32 = [f"{NAMES[i % len(NAMES)]}:" + " " * (i // len(NAMES)) for i in range(32)]
    for _ in range(args.reps):
        res["batch1"].append(_round(llm, ["ROMEO:"], structured))
        res["batch32"].append(_round(llm, prompts32, structured))
    for key in ("batch1", "batch32"):
        res[key + "_median_ratio"] = statistics.median(r["ratio"] for r in res[key])
        res[key + "_median_ratio_same_path"] = statistics.median(r["ratio_same_path"] for r in res[key])
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "schema"}, indent=1), file=sys.stderr)


if __name__ == "__main__":
    main()
