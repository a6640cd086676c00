"""The shipped tiny-llava on its held-out set, through the engine: accuracy equals its model card's, with the
float encoder and within the quality gate with the INT8 one (feature cosine >= 0.99, accuracy drop <= 1
point)."""
import re
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_MODEL
from tokenmill.multimodal import synthetic
from tokenmill.multimodal.preprocess import ImageProcessor

MODEL = str(Path(DEFAULT_MODEL).parent / "tiny-llava")
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def card_accuracy() -> tuple[int, int]:
    """(correct, total) from the card's 'overall' row."""
    text = (Path(MODEL) / "README.md").read_text()
    m = re.search(r"\*\*overall\*\*[^\n]*?(\d+)/(\d+)", text)
    assert m, "the model card has no overall accuracy row"
    return int(m.group(1)), int(m.group(2))


def conversation(sample) -> list[dict]:
    frames = sample.video if sample.video is not None else sample.images
    parts = [{"type": "image", "image": f} for f in frames]  # a video is fed as its frames, as in training
    return [{"role": "user", "content": parts + [{"type": "text", "text": sample.question}]}]


def correct(llm: LLM, samples) -> int:
    outs = llm.chat([conversation(s) for s in samples], GREEDY, use_tqdm=False)
    return sum(synthetic.is_correct(s, o.outputs[0].text) for s, o in zip(samples, outs))


@pytest.fixture(scope="module")
def samples():
    return synthetic.eval_samples()


@pytest.fixture(scope="module")
def float_llm():
    return LLM(MODEL, dtype="float32")


def test_accuracy_equals_the_model_card(float_llm, samples):
    want, total = card_accuracy()
    assert total == len(samples)
    assert correct(float_llm, samples) == want


@pytest.mark.parametrize("method", ["int8", "w8a8"])
def test_int8_encoder_passes_the_quality_gate(float_llm, samples, method):
    llm = LLM(MODEL, dtype="float32", mm_encoder_quantization=method)
    frames = [f for s in samples[:64] for f in (s.video if s.video is not None else s.images)]
    pixels = torch.from_numpy(ImageProcessor.from_model_dir(MODEL)(frames))
    with torch.inference_mode():
        ref = float_llm.llm_engine.core.runner.model.encode_images(pixels).flatten(1)
        got = llm.llm_engine.core.runner.model.encode_images(pixels).flatten(1)
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    assert cos.min() >= 0.99
    assert (got != ref).any()  # really quantized
    base = correct(float_llm, samples)
    assert correct(llm, samples) >= base - len(samples) // 100  # at most 1 point lower
