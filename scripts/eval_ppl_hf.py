#!/usr/bin/env python
"""Reproduce the model cards' validation perplexity with transformers (float32, CPU).

    python scripts/eval_ppl_hf.py                       # both shipped models
    python scripts/eval_ppl_hf.py path/to/model_dir     # any local HF causal LM dir

Tokenizes the eval text with the model's own tokenizer (add_special_tokens=False) and scores
it with tokenmill.evaluation.perplexity.perplexity: non-overlapping windows of
max_position_embeddings tokens, bos prepended to each window (unless --no-bos).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "tokenmill" / "assets" / "models"
DEFAULT_TEXT = REPO / "tokenmill" / "assets" / "eval" / "shakespeare_valid.txt"


def load_perplexity():
    # Load by path: the module is dependency-free and this keeps the script independent of
    # whatever tokenmill/__init__.py imports.
    spec = importlib.util.spec_from_file_location(
        "tokenmill_perplexity", REPO / "tokenmill" / "evaluation" / "perplexity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.perplexity


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dirs", nargs="*",
                    default=[str(MODELS / "tiny-shakespeare"), str(MODELS / "tiny-shakespeare-draft")])
    ap.add_argument("--text", default=str(DEFAULT_TEXT))
    ap.add_argument("--window", type=int, default=None, help="default: max_position_embeddings")
    ap.add_argument("--no-bos", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    perplexity = load_perplexity()
    text = Path(args.text).read_text(encoding="utf-8")

    for model_dir in args.model_dirs:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = tok(text, add_special_tokens=False)["input_ids"]
        window = args.window or model.config.max_position_embeddings
        bos_id = None if args.no_bos else tok.bos_token_id

        @torch.no_grad()
        def logits_fn(window_ids: list[int]) -> torch.Tensor:
            return model(input_ids=torch.tensor([window_ids])).logits[0].float()

        result = perplexity(logits_fn, ids, window, bos_id)
        print(json.dumps({"model": str(model_dir), "window": window, "bos_id": bos_id, **result}))


if __name__ == "__main__":
    main()
