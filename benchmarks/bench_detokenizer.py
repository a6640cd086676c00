"""Incremental detokenization's cost per token as the output grows (engine/detokenizer.py): the shipped
tokenizer, one long output decoded a token at a time, us per token in each block of `--block` tokens, without
and with a stop string (which searches the new text's tail); and a non-streaming request's pending output
taking one delta per token (engine/async_llm.py `_merge`).

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


def merge_per_block(pieces: list[str], block: int) -> list[float]:
    from tokenmill.engine.async_llm import _merge
    from tokenmill.outputs import CompletionOutput, RequestOutput

    def delta(text: str) -> RequestOutput:
        return RequestOutput("r", None, [], [CompletionOutput(0, text, [0])], False)
    pending, out, t = delta(pieces[0]), [], time.perf_counter()
    for i, piece in enumerate(pieces[1:], 1):
        pending = _merge(pending, delta(piece))
        if i % block == 0:
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
           "us_per_token_stop": per_block(tok, ids, args.block, ["zzqq"]),
           "us_per_merged_delta": merge_per_block([tok.decode([i]) for i in ids] + [""], args.block)}
    for k in ("us_per_token_plain", "us_per_token_stop", "us_per_merged_delta"):
        print(k, res[k])
    write_json(res, args.out)


if __name__ == "__main__":
    main()
