"""What n-gram speculation buys requests held to a JSON schema: output tok/s with and without
`speculative_config` (n-gram, k = 3), the same greedy requests in the same process, alternated for --reps
rounds. The prompts hold JSON records of the schema's shape (an extraction task: the output repeats the
keys and much of the text), which is where prompt lookup finds drafts; the grammar cuts each draft where it
refuses a token. Shipped model, float32, batch 1 and 8. Also checks the two engines' tokens are identical.

    python benchmarks/bench_structured_spec.py --out benchmarks/results/structured_spec.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

NAMES = ["ROMEO", "JULIET", "MERCUTIO", "TYBALT", "NURSE", "CAPULET", "MONTAGUE", "BENVOLIO"]
SCHEMA = {"type": "array", "minItems": 1, "maxItems": 4,
          "items": {"type": "object", "additionalProperties": False, "required": ["speaker", "line"],
                    "properties": {"speaker": {"enum": NAMES}, "line": {"type": "string", "maxLength": 48}}}}
LINES = ["But soft, what light through yonder window breaks", "O Romeo, Romeo, wherefore art thou Romeo",
         "A plague on both your houses", "Good night, good night, parting is such sweet sorrow"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompt(i: int) -> str:
    rows = [{"speaker": NAMES[(i + j) % len(NAMES)], "line": LINES[(i + j) % len(LINES)][:48]} for j in range(3)]
    return json.dumps(rows) + "\n" + NAMES[i % len(NAMES)] + ":"


def _timed(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from common import machine, write_json
    from tokenmill import LLM, SamplingParams

    engines = {"plain": LLM(dtype="float32", max_model_len=512),
               "ngram": LLM(dtype="float32", max_model_len=512, speculative_config=NGRAM)}
    sp = SamplingParams(temperature=0, max_tokens=160,
                        structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    batches = {"batch1": [_prompt(0)], "batch8": [_prompt(i) for i in range(8)]}
    for llm in engines.values():  # warm-up: compile, xgrammar's import
        llm.generate(batches["batch1"], sp, use_tqdm=False)
    res = {"machine": machine(), "schema": SCHEMA, "ngram": NGRAM}
    for key, prompts in batches.items():
        rounds = []
        for _ in range(args.reps):
            r = {}
            for name, llm in engines.items():
                dt, toks = _timed(llm, prompts, sp)
                r[name + "_tok_s"], r[name + "_tokens"] = sum(map(len, toks)) / dt, toks
            r["identical"] = r.pop("plain_tokens") == r.pop("ngram_tokens")
            r["speedup"] = r["ngram_tok_s"] / r["plain_tok_s"]
            rounds.append(r)
        res[key] = rounds
        res[key + "_median_speedup"] = statistics.median(r["speedup"] for r in rounds)
        res[key + "_identical"] = all(r["identical"] for r in rounds)
    st = engines["ngram"].llm_engine.core.scheduler.spec.stats
    res["acceptance_rate"], res["mean_acceptance_length"] = st.acceptance_rate, st.mean_acceptance_length
    write_json(res, args.out)
    print(json.dumps({k: v for k, v in res.items() if k not in ("schema", "batch1", "batch8")}, indent=1))


if __name__ == "__main__":
    main()
