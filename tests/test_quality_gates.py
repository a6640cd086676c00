"""Quality gates on the shipped model: validation perplexity through the engine, float32.
Figures (and the commands that reproduce them) are in docs/quantization.md and BENCHMARKS.md."""
import pytest

from tokenmill.config import DEFAULT_MODEL
from tokenmill.evaluation.engine_ppl import evaluate_perplexity


@pytest.fixture(scope="module")
def float_ppl():
    return evaluate_perplexity(DEFAULT_MODEL)["ppl"]


def increase(ppl: float, base: float) -> float:
    return ppl / base - 1


@pytest.mark.parametrize("kw", [dict(quantization="int8"), dict(quantization="int8", quantize_lm_head=True)])
def test_int8_weight_only_within_one_percent(float_ppl, kw):
    ppl = evaluate_perplexity(DEFAULT_MODEL, **kw)["ppl"]
    assert ppl != float_ppl  # really quantized
    assert increase(ppl, float_ppl) <= 0.01


def test_w8a8_within_one_percent(float_ppl):
    ppl = evaluate_perplexity(DEFAULT_MODEL, quantization="w8a8")["ppl"]
    assert ppl != float_ppl and abs(increase(ppl, float_ppl)) <= 0.01
