"""Calibration samples for `tokenmill quantize`: N windows of L tokens from a text file.

The default text is `assets/eval/shakespeare_calib.txt`, a bounded sample of the shipped model's
*training* split (written by `scripts/train_tiny_model.py --stage calib`), never the validation
plays that perplexity is measured on.

    file (.txt: one document; .jsonl: one {"text": ...} per line)
      -> token stream  doc1 [eos] doc2 [eos] ...   (a .txt is one document, no eos)
      -> non-overlapping windows of L - len(prefix) tokens, N of them drawn with the seed
      -> each sample = prefix + window, prefix = what the tokenizer puts first (Llama: [bos])

Rules (checked before any model weights are loaded): the file exists; N >= 1, L >= MIN_SEQ_LEN;
N * L is at least MIN_CALIB_TOKENS; L fits the model's context; the stream holds at least N * L
tokens, so the N windows never overlap.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

DEFAULT_CALIB_PATH = Path(__file__).resolve().parents[1] / "assets" / "eval" / "shakespeare_calib.txt"
MIN_CALIB_TOKENS = 256
MIN_SEQ_LEN = 8


def read_documents(path: str | Path) -> list[str]:
    """A .jsonl file -> the "text" field of each line; any other file -> its whole text."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"calibration data {str(path)!r} does not exist or is not a file")
    raw = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl":
        return [raw]
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"calibration data {str(path)!r} line {n} is not JSON: {e}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"calibration data {str(path)!r} line {n} has no string \"text\" field")
        docs.append(record["text"])
    return docs


def token_stream(tokenizer, docs: list[str]) -> list[int]:
    def encode(text: str) -> list[int]:  # verbose=False: no "longer than the maximum length" warning
        return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    if len(docs) == 1:
        return encode(docs[0])
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [i for doc in docs for i in encode(doc) + eos]


def check_sample_shape(num_samples: int, seq_len: int, max_len: int | None) -> None:
    if num_samples < 1 or seq_len < MIN_SEQ_LEN:
        raise ValueError(f"--num-samples must be at least 1 and --seq-len at least {MIN_SEQ_LEN}, "
                         f"got {num_samples} and {seq_len}")
    if num_samples * seq_len < MIN_CALIB_TOKENS:
        raise ValueError(f"--num-samples x --seq-len = {num_samples} x {seq_len} = {num_samples * seq_len} "
                         f"calibration tokens, below the minimum of {MIN_CALIB_TOKENS}")
    if max_len is not None and seq_len > max_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_len}")


def calibration_samples(tokenizer, path: str | Path, num_samples: int, seq_len: int, seed: int = 0,
                        max_len: int | None = None) -> torch.Tensor:
    """LongTensor [num_samples, seq_len] (see the module docstring); ValueError on a bad file or shape."""
    check_sample_shape(num_samples, seq_len, max_len)
    ids = token_stream(tokenizer, read_documents(path))
    need = num_samples * seq_len
    if len(ids) < need:
        raise ValueError(f"calibration data {str(path)!r} has {len(ids)} tokens, fewer than --num-samples x "
                         f"--seq-len = {num_samples} x {seq_len} = {need}")
    prefix = tokenizer("", add_special_tokens=True)["input_ids"]
    step = seq_len - len(prefix)
    order = torch.randperm(len(ids) // step, generator=torch.Generator().manual_seed(seed))[:num_samples]
    stream, head = torch.tensor(ids, dtype=torch.long), torch.tensor(prefix, dtype=torch.long)
    return torch.stack([torch.cat([head, stream[i * step:(i + 1) * step]]) for i in order.tolist()])
