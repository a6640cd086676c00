"""The shipped tiny-shakespeare models: tokenmill matches transformers, and the model card's
perplexity reproduces through the engine."""
import re
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_MODEL

MODELS = Path(DEFAULT_MODEL).parent
TARGET, DRAFT = MODELS / "tiny-shakespeare", MODELS / "tiny-shakespeare-draft"
PROMPTS = ["ROMEO:\nBut soft, what light", "To be, or not to be", "KING RICHARD.\nNow is the", "O"]


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
def test_greedy_matches_transformers(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)


def card_perplexity(path: Path, window: int) -> float:
    card = (path / "README.md").read_text()
    m = re.search(r"\|\s*\*\*" + re.escape(path.name) + rf"\*\*\s*\|\s*{window}\s*\|\s*[\d.]+\s*\|\s*\*\*([\d.]+)\*\*", card)
    assert m, f"the model card states no validation perplexity at window {window}"
    return float(m.group(1))


@pytest.mark.parametrize("window", [512, 8192])
def test_engine_perplexity_matches_model_card(window):
    """512: the first stage's context; 8192: the long-context stage's (positions past 512 exercise the
    raised RoPE base through the engine's own rotary tables and paged attention)."""
    from tokenmill.evaluation.engine_ppl import evaluate_perplexity

    res = evaluate_perplexity(str(TARGET), window=window)
    assert res["window"] == window
    expected = card_perplexity(TARGET, window)
    assert abs(res["ppl"] - expected) / expected < 0.01, (res["ppl"], expected)


def test_shipped_models_hold_8k():
    from transformers import AutoConfig

    for path in (TARGET, DRAFT):
        assert AutoConfig.from_pretrained(path).max_position_embeddings == 8192
        for window in (512, 2048, 8192):
            card_perplexity(path, window)


def test_default_model_is_the_shipped_one():
    assert Path(DEFAULT_MODEL) == TARGET and (TARGET / "model.safetensors").is_file()


def _long_prompt() -> str:
    """~5K tokens of a held-out play, a blank line, then the speaker line and first line of one of its
    speeches."""
    text = (MODELS.parent / "eval" / "shakespeare_valid.txt").read_text()
    start = text.index("\n\n", 100_000) + 2
    doc = text[start:start + 14_000]
    cue_at = doc.index("\n\n", 6_000) + 2
    cue_end = doc.index("\n", doc.index("\n", cue_at) + 1) + 1
    return doc + "\n\n" + doc[cue_at:cue_end]


def test_long_prompts_match_transformers_with_and_without_ngram_drafts():
    """Thousands of positions into the long-context model (RoPE base 100000): the engine's greedy tokens
    equal transformers', and n-gram speculation over that prompt gives the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    prompt = _long_prompt()
    ids = tok(prompt)["input_ids"]
    assert 4_000 < len(ids) < 8_000
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                      pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(str(TARGET), dtype="float32").generate([prompt], sp, use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == ref
    llm = LLM(str(TARGET), dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    assert llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert llm.llm_engine.get_stats().spec_num_draft_tokens > 0
