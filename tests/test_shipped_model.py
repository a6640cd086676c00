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


def card_perplexity(path: Path) -> float:
    card = (path / "README.md").read_text()
    m = re.search(r"\|\s*\*\*" + re.escape(path.name) + r"\*\*\s*\|\s*[\d.]+\s*\|\s*\*\*([\d.]+)\*\*", card)
    assert m, "the model card states no validation perplexity"
    return float(m.group(1))


def test_engine_perplexity_matches_model_card():
    from tokenmill.evaluation.engine_ppl import evaluate_perplexity

    res = evaluate_perplexity(str(TARGET))
    expected = card_perplexity(TARGET)
    assert abs(res["ppl"] - expected) / expected < 0.01, (res["ppl"], expected)


def test_default_model_is_the_shipped_one():
    assert Path(DEFAULT_MODEL) == TARGET and (TARGET / "model.safetensors").is_file()
