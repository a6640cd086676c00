"""What a structured-output request's grammar costs before its first token: xgrammar's parse (what the front end
runs to refuse a bad grammar, `GrammarCompiler.validate`) against its compile against the vocabulary (what the
engine runs, once; the front end ran it too before session 35). Per schema, median of --reps fresh compilers
(no cache), for the shipped model's tokenizer and for a byte-level BPE of --vocab tokens trained here on Python
source (no hub: a stand-in for a real model's 128K-150K vocabulary).

    python benchmarks/bench_grammar_compile.py --out benchmarks/results/grammar_compile.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

SCHEMAS = {
    "flat_20_fields": {"type": "object", "required": [f"f{i}" for i in range(20)],
                       "properties": {f"f{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(20)}},
    "nested_8": None,  # built below
    "array_of_records": {"type": "array", "maxItems": 8, "items": {
        "type": "object", "required": ["name", "age", "tags"],
        "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}},
}


def _nested(levels: int) -> dict:
    schema = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "required": [f"k{i}"], "properties": {f"k{i}": schema, "n": {"type": "number"}}}
    return schema


SCHEMAS["nested_8"] = _nested(8)


def _trained_tokenizer(vocab: int, cache: str):
    """A byte-level BPE of `vocab` tokens over this interpreter's Python sources, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(cache, f"bpe-{vocab}.json")
    if not os.path.exists(path):
        files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))[:4000]
        text = []
        for f in files:  # (a few test files are not UTF-8)
            try:
                with open(f, encoding="utf-8") as fh:
                    text.append(fh.read())
            except (UnicodeDecodeError, OSError):
                pass
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        os.makedirs(cache, exist_ok=True)
        tok.save(path)
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<eos>")


def _times(tokenizer, vocab_size: int, reps: int) -> dict:
    from tokenmill.sample.grammar import GrammarCompiler
    from tokenmill.sampling_params import StructuredOutputsParams

    out = {}
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        parse, compile_ = [], []
        for _ in range(reps):
            c = GrammarCompiler(tokenizer, vocab_size)
            c.validate(StructuredOutputsParams(choice=["warm"]))  # the tokenizer's info, once per process
            t = time.perf_counter()
            c.validate(spec)
            parse.append(time.perf_counter() - t)
            t = time.perf_counter()
            c.compile(spec)
            compile_.append(time.perf_counter() - t)
        out[name] = {"parse_ms": statistics.median(parse) * 1e3, "compile_ms": statistics.median(compile_) * 1e3}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=50000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache", default="/tmp/tokenmill-bench-bpe")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import tokenmill
    from common import machine, write_json
    from tokenmill.tokenizer import load_tokenizer

    shipped = load_tokenizer(os.path.join(os.path.dirname(tokenmill.__file__), "assets", "models", "tiny-shakespeare"))
    trained = _trained_tokenizer(args.vocab, args.cache)
    res = {"machine": machine(), "reps": args.reps,
           "shipped": {"vocab": len(shipped), **_times(shipped, len(shipped), args.reps)},
           "trained": {"vocab": len(trained), **_times(trained, len(trained), args.reps)}}
    write_json(res, args.out)
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))


if __name__ == "__main__":
    main()
