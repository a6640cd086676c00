"""Benchmark workloads: lists of SampleRequest, the same for `bench serve` and `bench offline`.

Each dataset is a class with `sample(num_requests, tokenizer, rng) -> list[SampleRequest]`, registered in
DATASETS by name. To add one (e.g. random images later): subclass Dataset, fill `multi_modal_data` with
OpenAI content parts ({"type": "image_url", ...}), register it, and add its flags in `add_dataset_args`.

With a tokenizer, synthetic prompts are token-id lists, so the prompt length is exact (text would not
round-trip through the tokenizer). Without one, prompts are text and lengths are estimates.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

_WORDS = ("the quick brown fox jumps over a lazy dog while seven bold wizards quietly judge "
          "every sphinx of black quartz near my big vow").split()
LONG_DOC_TEXT = Path(__file__).resolve().parent.parent / "assets" / "eval" / "shakespeare_valid.txt"


@dataclass
class SampleRequest:
    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    multi_modal_data: list[dict] | None = None  # OpenAI content parts, for chat requests; None for text-only
    request_id: str | None = None
    length_class: str | None = None  # "short" / "long" in mixed workloads: results are broken down by it


class Dataset:
    name = ""

    def sample(self, num_requests: int, tokenizer, rng: random.Random) -> list[SampleRequest]:
        raise NotImplementedError


def _content_ids(tokenizer) -> list[int]:
    """Token ids safe to put in a prompt: the vocabulary minus special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return [i for i in range(len(tokenizer)) if i not in special]


def _random_prompt(n: int, tokenizer, rng: random.Random, pool: list[int] | None) -> str | list[int]:
    if tokenizer is not None:
        return [rng.choice(pool) for _ in range(n)]
    return " ".join(rng.choice(_WORDS) for _ in range(n))  # ~1 token per word on BPE vocabularies


def _lengths(mean: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    """Uniform in [mean*(1-ratio), mean*(1+ratio)], as vLLM's --random-range-ratio."""
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class RandomDataset(Dataset):
    name = "random"

    def __init__(self, input_len: int = 256, output_len: int = 128, range_ratio: float = 0.0):
        self.input_len, self.output_len, self.range_ratio = input_len, output_len, range_ratio

    def sample(self, num_requests, tokenizer, rng):
        pool = _content_ids(tokenizer) if tokenizer is not None else None
        ins = _lengths(self.input_len, self.range_ratio, num_requests, rng)
        outs = _lengths(self.output_len, self.range_ratio, num_requests, rng)
        return [SampleRequest(_random_prompt(i, tokenizer, rng, pool), i, o) for i, o in zip(ins, outs)]


class PrefixRepetitionDataset(Dataset):
    """Prompts = one of `num_prefixes` shared prefixes + a random suffix: what prefix caching is for."""

    name = "prefix-repetition"

    def __init__(self, prefix_len: int = 256, suffix_len: int = 64, num_prefixes: int = 4, output_len: int = 128):
        if num_prefixes < 1:
            raise ValueError("--num-prefixes must be >= 1")
        self.prefix_len, self.suffix_len, self.num_prefixes, self.output_len = (
            prefix_len, suffix_len, num_prefixes, output_len)

    def sample(self, num_requests, tokenizer, rng):
        pool = _content_ids(tokenizer) if tokenizer is not None else None
        prefixes = [_random_prompt(self.prefix_len, tokenizer, rng, pool) for _ in range(self.num_prefixes)]
        reqs = []
        for i in range(num_requests):
            prefix = prefixes[i % self.num_prefixes]
            suffix = _random_prompt(self.suffix_len, tokenizer, rng, pool)
            prompt = prefix + suffix if tokenizer is not None else f"{prefix} {suffix}"
            reqs.append(SampleRequest(prompt, self.prefix_len + self.suffix_len, self.output_len))
        rng.shuffle(reqs)  # interleave prefixes so cache hits are not just back-to-back repeats
        return reqs


class ShareGPTDataset(Dataset):
    """A ShareGPT-format JSON file: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}].
    First turn = prompt; the reply's token count = output length (unless output_len is fixed). Filters as vLLM:
    prompt and reply at least 4 tokens, prompt <= 1024, prompt + reply <= 2048."""

    name = "sharegpt"

    def __init__(self, path: str, output_len: int | None = None, max_prompt_len: int = 1024,
                 max_total_len: int = 2048):
        if not path:
            raise ValueError("the sharegpt dataset needs --dataset-path FILE.json")
        self.path, self.output_len = path, output_len
        self.max_prompt_len, self.max_total_len = max_prompt_len, max_total_len

    def sample(self, num_requests, tokenizer, rng):
        with open(self.path, encoding="utf-8") as f:
            data = json.load(f)
        convs = [d.get("conversations") or d.get("conversation") or [] for d in data]
        pairs = [(c[0]["value"], c[1]["value"]) for c in convs if len(c) >= 2]
        rng.shuffle(pairs)
        count = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer is not None else (
            lambda s: max(1, len(s) // 4))  # no tokenizer: ~4 characters per token
        reqs = []
        for prompt, reply in pairs:
            if len(reqs) == num_requests:
                break
            p_len = count(prompt)
            o_len = self.output_len or count(reply)
            if p_len < 4 or (self.output_len is None and o_len < 4):
                continue
            if p_len > self.max_prompt_len or p_len + o_len > self.max_total_len:
                continue
            reqs.append(SampleRequest(prompt, p_len, o_len))
        if len(reqs) < num_requests:
            raise ValueError(f"{self.path}: only {len(reqs)} usable conversations, {num_requests} requested")
        return reqs


class LongDocumentDataset(Dataset):
    """Long prompts (8K tokens by default) cut from real text at random offsets: long-context work."""

    name = "long-document"

    def __init__(self, doc_len: int = 8192, output_len: int = 128, path: str | None = None):
        self.doc_len, self.output_len, self.path = doc_len, output_len, path or str(LONG_DOC_TEXT)

    def sample(self, num_requests, tokenizer, rng):
        text = Path(self.path).read_text(encoding="utf-8")
        if tokenizer is None:
            chars = self.doc_len * 4  # ~4 characters per token
            if len(text) < chars:
                text = text * (chars // len(text) + 1)
            starts = [rng.randrange(0, len(text) - chars + 1) for _ in range(num_requests)]
            return [SampleRequest(text[s:s + chars], self.doc_len, self.output_len) for s in starts]
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < self.doc_len:
            ids = ids * (self.doc_len // len(ids) + 1)
        starts = [rng.randrange(0, len(ids) - self.doc_len + 1) for _ in range(num_requests)]
        return [SampleRequest(ids[s:s + self.doc_len], self.doc_len, self.output_len) for s in starts]


class LongTextDataset(Dataset):
    """The playbook's long-text traffic: short prompts mixed with questions about long documents.

    `long_fraction` of the requests are long: a document of `doc_len` tokens (cut from real text) followed
    by a question of `question_len` tokens; each document gets `questions_per_doc` different questions, as
    in long-document QA and summarisation, so the document is a shared prefix. The rest are short random
    prompts of `short_len` tokens. Arrivals are shuffled, so a document's questions spread over the run.

        request:  [ document d (doc_len) ........................ | question q (question_len) ]   "long"
                  [ short prompt (short_len) ]                                                    "short"
    """

    name = "long-text"

    def __init__(self, doc_len: int = 8192, short_len: int = 256, question_len: int = 32,
                 questions_per_doc: int = 4, long_fraction: float = 0.25, output_len: int = 128,
                 path: str | None = None):
        if not 0 < long_fraction <= 1:
            raise ValueError(f"--long-fraction must be in (0, 1], got {long_fraction}")
        if questions_per_doc < 1:
            raise ValueError("--questions-per-doc must be >= 1")
        self.doc_len, self.short_len, self.question_len = doc_len, short_len, question_len
        self.questions_per_doc, self.long_fraction, self.output_len = questions_per_doc, long_fraction, output_len
        self.path = path

    def sample(self, num_requests, tokenizer, rng):
        num_long = max(1, round(self.long_fraction * num_requests))
        num_docs = -(-num_long // self.questions_per_doc)
        docs = LongDocumentDataset(self.doc_len, self.output_len, self.path).sample(num_docs, tokenizer, rng)
        pool = _content_ids(tokenizer) if tokenizer is not None else None
        reqs = []
        for i in range(num_long):
            doc = docs[i // self.questions_per_doc].prompt
            question = _random_prompt(self.question_len, tokenizer, rng, pool)
            prompt = doc + question if tokenizer is not None else f"{doc}\n\n{question}"
            reqs.append(SampleRequest(prompt, self.doc_len + self.question_len, self.output_len, length_class="long"))
        for _ in range(num_requests - num_long):
            reqs.append(SampleRequest(_random_prompt(self.short_len, tokenizer, rng, pool), self.short_len,
                                      self.output_len, length_class="short"))
        rng.shuffle(reqs)
        return reqs


DATASETS = {c.name: c for c in (RandomDataset, PrefixRepetitionDataset, ShareGPTDataset, LongDocumentDataset,
                                LongTextDataset)}


def add_dataset_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=sorted(DATASETS))
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (sharegpt); text file (long-document)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256)
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=None,
                   help="output tokens per request (default 128; sharegpt: the reply's length)")
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--prefix-len", type=int, default=256)
    g.add_argument("--suffix-len", type=int, default=64)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--long-doc-len", type=int, default=8192, help="document tokens (long-document, long-text)")
    g.add_argument("--question-len", type=int, default=32, help="long-text: question tokens after each document")
    g.add_argument("--questions-per-doc", type=int, default=4, help="long-text: questions asked of each document")
    g.add_argument("--long-fraction", type=float, default=0.25,
                   help="long-text: share of requests that are document questions (the rest: --input-len tokens)")
    if seed:  # `bench offline` shares the engine's --seed
        g.add_argument("--seed", type=int, default=0)


def dataset_from_args(args) -> Dataset:
    out = args.output_len
    name = args.dataset_name
    if name == "random":
        return RandomDataset(args.input_len, out or 128, args.random_range_ratio)
    if name == "prefix-repetition":
        return PrefixRepetitionDataset(args.prefix_len, args.suffix_len, args.num_prefixes, out or 128)
    if name == "sharegpt":
        return ShareGPTDataset(args.dataset_path, out)
    if name == "long-document":
        return LongDocumentDataset(args.long_doc_len, out or 128, args.dataset_path)
    if name == "long-text":
        return LongTextDataset(args.long_doc_len, args.input_len, args.question_len, args.questions_per_doc,
                               args.long_fraction, out or 128, args.dataset_path)
    raise ValueError(f"unknown dataset {name!r}")


def sample_requests(dataset: Dataset, num_requests: int, tokenizer=None, seed: int = 0) -> list[SampleRequest]:
    reqs = dataset.sample(num_requests, tokenizer, random.Random(seed))
    for i, r in enumerate(reqs):
        r.request_id = r.request_id or f"bench-{i}"
    return reqs


def dataset_config(args) -> dict:
    """The workload settings recorded in a result file."""
    keys = {"random": ("input_len", "output_len", "random_range_ratio"),
            "prefix-repetition": ("prefix_len", "suffix_len", "num_prefixes", "output_len"),
            "sharegpt": ("dataset_path", "output_len"),
            "long-document": ("long_doc_len", "output_len", "dataset_path"),
            "long-text": ("long_doc_len", "input_len", "question_len", "questions_per_doc", "long_fraction",
                          "output_len", "dataset_path")}[args.dataset_name]
    return {"dataset_name": args.dataset_name, "num_prompts": args.num_prompts, "seed": args.seed,
            **{k: getattr(args, k) for k in keys}}


def get_tokenizer(path: str | None):
    """A local tokenizer for exact prompt lengths and token counts; None when there is none to load."""
    import os

    if not path or not os.path.isdir(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
