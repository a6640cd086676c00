"""Incremental detokenization's cost per token as the output grows (engine/detokenizer.py): the shipped
tokenizer, one long output decoded a token at a time, us per token in each block of `--block` tokens, without
and with a stop string (which searches the new text's tail).

    python benchmarks/bench_detokenizer.py --tokens 40000 --out benchmarks/results/detokenizer.json
"""
from __future__ import annotations

import argparse
import time

from common import machine, write_json

from tokenmill.config import DEFAULT_MODEL
from tokenmill.engine.detokenizer import IncrementalDetokenizer


def per_block(tok, ids: list[int], block: int, stop: list[str] | None) -> list[float]:
    d = IncrementalDetokenizer(tok, ids[:5], stop=stop)
    out, t = [], time.perf_counter()
    for i, token in enumerate(ids):
        d.update([token])
        if (i + 1) % block == 0:
            out.append(round((time.perf_counter() - t) / block * 1e6, 3))
            t = time.perf_counter()
    return out


def main() -> None:
    from transformers import AutoTokenizer
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40000)
    ap.add_argument("--block", type=int, default=10000)
    ap.add_argument("--out", default="benchmarks/results/detokenizer.json")
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    text = "To be, or not to be, that is the question. "
    ids = tok(text * (args.tokens // 8 + 1))["input_ids"][:args.tokens]
    res = {"machine": machine(), "tokens": len(ids), "block": args.block,
           "us_per_token_plain": per_block(tok, ids, args.block, None),
           "us_per_token_stop": per_block(tok, ids, args.block, ["zzqq"])}
    for k in ("us_per_token_plain", "us_per_token_stop"):
        print(k, res[k])
    write_json(res, args.out)


if __name__ == "__main__":
    main()
