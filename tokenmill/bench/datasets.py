"""Benchmark workloads: lists of SampleRequest, the same for `bench serve` and `bench offline`.

Each dataset is a class with `sample(num_requests, tokenizer, rng) -> list[SampleRequest]`, registered in
DATASETS by name. To add one: subclass Dataset, fill `multi_modal_data` with OpenAI content parts
({"type": "image_url", ...}, as `random-mm` does), register it, and add its flags in `add_dataset_args`.

With a tokenizer, synthetic prompts are token-id lists, so the prompt length is exact (text would not
round-trip through the tokenizer). Without one, prompts are text and lengths are estimates.
"""
from __future__ import annotations

import argparse
import base64
import io
import random
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.checks import read_json
from tokenmill.entrypoints.openai.cli_args import positive_int

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
        data = read_json(self.path, list, "not a ShareGPT JSON file",
                         "a ShareGPT file is a JSON list of conversations, this is a {type}")
        # as vLLM: entries without two usable turns are skipped; an error only where none is left
        pairs = [pair for d in data if (pair := _sharegpt_pair(d))]
        if data and not pairs:
            raise ValueError(f"{self.path}: no entry has the ShareGPT shape "
                             '{"conversations": [{"value": PROMPT}, {"value": REPLY}, ...]}')
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
            skipped = len(data) - len(pairs)
            raise ValueError(f"{self.path}: only {len(reqs)} usable conversations, {num_requests} requested"
                             + (f" ({skipped} entries without two text turns skipped)" if skipped else ""))
        return reqs


def _sharegpt_pair(entry) -> tuple[str, str] | None:
    """(prompt, reply): the first two turns' "value" texts; None where the entry has no such turns."""
    conv = (entry.get("conversations") or entry.get("conversation")) if isinstance(entry, dict) else None
    if not isinstance(conv, list) or len(conv) < 2:
        return None
    turns = [t.get("value") if isinstance(t, dict) else None for t in conv[:2]]
    return (turns[0], turns[1]) if all(isinstance(t, str) for t in turns) else None


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


def parse_image_size(size) -> tuple[int, int]:
    """"336x336" (or a (width, height) pair) -> (width, height)."""
    try:
        w, h = (int(x) for x in (size.lower().split("x") if isinstance(size, str) else size))
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"--mm-image-size must be WIDTHxHEIGHT, e.g. 336x336, got {size!r}") from None
    if w < 1 or h < 1:
        raise ValueError(f"--mm-image-size must be positive, got {size!r}")
    return w, h


def synthetic_image(size: tuple[int, int], rng: random.Random):
    """A PIL image: a noisy background of one colour with a few random ellipses, boxes and triangles."""
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = size
    gen = np.random.default_rng(rng.getrandbits(32))
    base = np.array([rng.randrange(256) for _ in range(3)], dtype=np.int16)
    pixels = np.clip(base + gen.integers(-8, 9, (h, w, 3), dtype=np.int16), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels)
    draw = ImageDraw.Draw(img)
    for _ in range(rng.randint(1, 5)):
        x0, x1 = sorted(rng.randrange(w) for _ in range(2))
        y0, y1 = sorted(rng.randrange(h) for _ in range(2))
        fill = tuple(rng.randrange(256) for _ in range(3))
        kind = rng.randrange(3)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([(x0, y1), (x1, y1), ((x0 + x1) // 2, y0)], fill=fill)
    return img


def _data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def image_part(img) -> dict:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)  # fast to write; decoding costs the same
    return {"type": "image_url", "image_url": {"url": _data_uri("image/png", buf.getvalue())}}


def video_part(frames: list) -> dict:
    """An animated GIF: the form of video a chat request can carry inline (the engine samples its frames)."""
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return {"type": "video_url", "video_url": {"url": _data_uri("image/gif", buf.getvalue())}}


class RandomMMDataset(Dataset):
    """vLLM's `random-mm`: random text prompts (as `random`) with synthetic images as chat content parts.

    Each request carries `images_per_request` PNG images of `image_size`, or, for a `video_fraction` share
    of the requests, one animated GIF of `video_frames` frames instead. `num_distinct_images` = 0 makes every
    image new; K > 0 draws them from a pool of K, so repeats hit the engine's encoder cache. `prompt_len`
    counts the text tokens only: a server's usage (and `bench offline`) counts the image placeholders too.
    Send them to a server with `--endpoint chat`.
    """

    name = "random-mm"

    def __init__(self, input_len: int = 256, output_len: int = 128, range_ratio: float = 0.0,
                 images_per_request: int = 1, image_size="336x336", num_distinct_images: int = 0,
                 video_fraction: float = 0.0, video_frames: int = 4):
        if images_per_request < 0 or num_distinct_images < 0 or video_frames < 1:
            raise ValueError("--mm-images-per-request and --mm-num-distinct-images must be >= 0, "
                             "--mm-video-frames >= 1")
        if not 0 <= video_fraction <= 1:
            raise ValueError(f"--mm-video-fraction must be in [0, 1], got {video_fraction}")
        self.text = RandomDataset(input_len, output_len, range_ratio)
        self.images_per_request, self.image_size = images_per_request, parse_image_size(image_size)
        self.num_distinct_images, self.video_fraction, self.video_frames = (
            num_distinct_images, video_fraction, video_frames)

    def sample(self, num_requests, tokenizer, rng):
        reqs = self.text.sample(num_requests, tokenizer, rng)
        pool = [image_part(synthetic_image(self.image_size, rng)) for _ in range(self.num_distinct_images)]
        videos = set(rng.sample(range(num_requests), round(self.video_fraction * num_requests)))
        for i, r in enumerate(reqs):
            if i in videos:
                r.multi_modal_data = [video_part([synthetic_image(self.image_size, rng)
                                                  for _ in range(self.video_frames)])]
            else:
                r.multi_modal_data = [rng.choice(pool) if pool else image_part(synthetic_image(self.image_size, rng))
                                      for _ in range(self.images_per_request)]
        return reqs


DATASETS = {c.name: c for c in (RandomDataset, PrefixRepetitionDataset, ShareGPTDataset, LongDocumentDataset,
                                LongTextDataset, RandomMMDataset)}


def add_dataset_args(p: argparse.ArgumentParser, seed: bool = True) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=sorted(DATASETS))
    g.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON (sharegpt); text file (long-document)")
    g.add_argument("--num-prompts", type=positive_int, default=100)
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256)
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=positive_int, default=None,
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
    g.add_argument("--mm-images-per-request", type=int, default=1, help="random-mm: images per request")
    g.add_argument("--mm-image-size", default="336x336", help="random-mm: WIDTHxHEIGHT of each synthetic image")
    g.add_argument("--mm-num-distinct-images", type=int, default=0,
                   help="random-mm: draw images from a pool of K (repeats hit the encoder cache); 0: all distinct")
    g.add_argument("--mm-video-fraction", type=float, default=0.0,
                   help="random-mm: share of requests carrying one video (an animated GIF) instead of images")
    g.add_argument("--mm-video-frames", type=int, default=4,
                   help="random-mm: frames of each video (the engine samples --mm-video-num-frames of them)")
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
    if name == "random-mm":
        if hasattr(args, "backend"):  # bench serve: images travel only in chat requests
            _require_chat_endpoint(args)
        return RandomMMDataset(args.input_len, out or 128, args.random_range_ratio, args.mm_images_per_request,
                               args.mm_image_size, args.mm_num_distinct_images, args.mm_video_fraction,
                               args.mm_video_frames)
    raise ValueError(f"unknown dataset {name!r}")


def _require_chat_endpoint(args) -> None:
    endpoint = args.endpoint or ("chat" if args.backend == "openai-chat" else "completions")
    if endpoint != "chat" and not endpoint.rstrip("/").endswith("chat/completions"):
        raise SystemExit("error: the random-mm dataset sends its images as chat content parts; run bench serve "
                         "with --endpoint chat (the completions endpoint takes no images)")


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
                          "output_len", "dataset_path"),
            "random-mm": ("input_len", "output_len", "random_range_ratio", "mm_images_per_request", "mm_image_size",
                          "mm_num_distinct_images", "mm_video_fraction", "mm_video_frames")}[args.dataset_name]
    return {"dataset_name": args.dataset_name, "num_prompts": args.num_prompts, "seed": args.seed,
            **{k: getattr(args, k) for k in keys}}


def get_tokenizer(path: str | None):
    """A local tokenizer for exact prompt lengths and token counts; None when there is none to load."""
    import os

    if not path or not os.path.isdir(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
