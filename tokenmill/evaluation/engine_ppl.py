"""`tokenmill eval ppl`: perplexity through the engine itself (paged attention, batching), scored on
exactly the windows of `perplexity.iter_windows`, so it compares with the model cards' figures."""
from __future__ import annotations

import math
from pathlib import Path

from tokenmill.evaluation.perplexity import iter_windows

DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "assets" / "eval" / "shakespeare_valid.txt"


def evaluate_perplexity(model: str, text_path: str | None = None, dtype: str = "float32",
                        window: int | None = None, bos: bool = True, **engine_kwargs) -> dict:
    from tokenmill import LLM, SamplingParams

    text = Path(text_path or DEFAULT_TEXT).read_text(encoding="utf-8")
    llm = LLM(model, dtype=dtype, **engine_kwargs)
    tok = llm.get_tokenizer()
    window = window or llm.llm_engine.max_model_len  # the model's limit unless --max-model-len says less
    tok.model_max_length = 1 << 62  # the text is windowed below; silence the long-input warning
    ids = tok(text, add_special_tokens=False)["input_ids"]
    windows = [w for w in iter_windows(ids, window, tok.bos_token_id if bos else None) if len(w) >= 2]
    # prompt_logprobs=0 returns each prompt token's logprob given everything before it in the window
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        for pos in range(1, len(w)):
            nll -= out.prompt_logprobs[pos][w[pos]].logprob
            count += 1
    if not count:
        raise ValueError(f"no tokens to score in {text_path or DEFAULT_TEXT} (it needs at least two)")
    mean = nll / count
    return {"model": model, "text": str(text_path or DEFAULT_TEXT), "window": window, "tokens": count,
            "nll": mean, "ppl": math.exp(mean), "dtype": dtype}
