"""`tokenmill quantize` (AWQ calibration and RTN): checkpoints read back through autoawq's own unpacking,
AWQ beating RTN where activations have outliers, every refused input, and the CLI end to end."""
from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from conftest import CORPUS, save_random_model
from tokenmill.entrypoints import cli
from tokenmill.quantization import awq_calibrate as ac
from tokenmill.quantization.awq_format import dequantize_w4, fake_w4, quantize_w4
from tokenmill.quantization.calib_data import calibration_samples
from tokenmill.quantization.checkpoint import dequantize_checkpoint
from tokenmill.quantization.outliers import make_outlier_model

SHIPPED = Path(ac.__file__).resolve().parents[1] / "assets" / "models" / "tiny-shakespeare"
VALID = SHIPPED.parents[1] / "eval" / "shakespeare_valid.txt"
SMALL = dict(num_samples=4, seq_len=64, progress=False)
W4 = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
W8 = {"quant_method": "awq", "bits": 8, "group_size": -1, "zero_point": False, "version": "tokenmill-w8"}


def autoawq_dequantize_gemm():
    """autoawq's unpacker, imported without running awq/__init__ (which pulls in `datasets`)."""
    if "awq" not in sys.modules:
        pkg = types.ModuleType("awq")
        pkg.__path__ = list(importlib.util.find_spec("awq").submodule_search_locations)
        sys.modules["awq"] = pkg
    from awq.utils.packing_utils import dequantize_gemm
    return dequantize_gemm


def build_tiny(path: Path, config) -> Path:
    save_random_model(str(path), config)
    return path


SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Random float32 Llama without GQA, so the v_proj -> o_proj group is searched too."""
    return build_tiny(tmp_path_factory.mktemp("tiny"), LlamaConfig(architectures=["LlamaForCausalLM"], **SHAPE))


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(CORPUS)
    return path


def logits(model_or_dir, ids: torch.Tensor) -> torch.Tensor:
    model = model_or_dir
    if not isinstance(model, torch.nn.Module):
        model = AutoModelForCausalLM.from_pretrained(model_or_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def linears(model):
    for i, layer in enumerate(model.model.layers):
        for name in ac.LINEARS:
            yield f"model.layers.{i}.{name}", layer.get_submodule(name)


def test_fake_w4_is_quantize_then_dequantize():
    w = torch.randn(16, 64)
    clip = w.abs().view(16, 2, 32).amax(-1) * 0.8
    for c in (None, clip):
        assert torch.equal(fake_w4(w, 32, c), dequantize_w4(*quantize_w4(w, 32, c), 32))


def test_w4_checkpoint_reads_back_with_autoawq(tiny, calib, tmp_path):
    model, summary = ac.quantize_model(tiny, tmp_path / "q", bits=4, group_size=32, calib_data=str(calib), **SMALL)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == W4
    assert "self_attn.v_proj->self_attn.o_proj" in summary["layers"][0]["alpha"]
    sd = load_file(tmp_path / "q" / "model.safetensors")
    dequantize_gemm = autoawq_dequantize_gemm()
    for prefix, lin in linears(model):
        n, k = lin.weight.shape
        assert sd[f"{prefix}.qweight"].shape == (k, n // 8) and sd[f"{prefix}.scales"].dtype == torch.float16
        # fp32 scales: autoawq's product is then exact, like ours
        w = dequantize_gemm(sd[f"{prefix}.qweight"], sd[f"{prefix}.qzeros"], sd[f"{prefix}.scales"].float(), 4, 32)
        assert torch.equal(w.t(), lin.weight), prefix
    assert torch.equal(sd["model.layers.1.input_layernorm.weight"], model.model.layers[1].input_layernorm.weight)
    ids = torch.randint(3, 512, (2, 48))
    restored = logits(dequantize_checkpoint(tmp_path / "q", tmp_path / "f32"), ids)
    assert torch.allclose(restored, logits(model, ids), atol=1e-5)
    ref = logits(tiny, ids)
    assert (restored - ref).norm() < 0.2 * ref.norm()


def test_w8_checkpoint(tiny, calib, tmp_path):
    model, _ = ac.quantize_model(tiny, tmp_path / "q", bits=8, calib_data=str(calib), **SMALL)
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == W8
    sd = load_file(tmp_path / "q" / "model.safetensors")
    for prefix, lin in linears(model):
        q, s = sd[f"{prefix}.qweight"], sd[f"{prefix}.scales"]
        assert (q.dtype, q.shape, s.dtype, s.shape) == (torch.int8, lin.weight.shape, torch.float16, (len(q),))
        assert torch.equal(q.float() * s.float()[:, None], lin.weight), prefix
    ids = torch.randint(3, 512, (2, 48))
    ref = logits(tiny, ids)
    assert (logits(model, ids) - ref).norm() < 0.02 * ref.norm()


def test_qwen2_biases_fold(tmp_path, calib):
    """Qwen2's q/k/v biases: v_proj's bias must be divided with its rows when s folds into o_proj."""
    config = Qwen2Config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, **SHAPE)
    src = build_tiny(tmp_path / "qwen2", config)
    with torch.no_grad():  # make the biases matter
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        for layer in model.model.layers:
            layer.self_attn.v_proj.bias.normal_(0, 1.0)
        model.save_pretrained(src)
    model, summary = ac.quantize_model(src, tmp_path / "q", bits=8, calib_data=str(calib), **SMALL)
    assert "self_attn.v_proj->self_attn.o_proj" in summary["layers"][0]["alpha"]
    ids = torch.randint(3, 512, (2, 48))
    ref, restored = logits(src, ids), logits(dequantize_checkpoint(tmp_path / "q", tmp_path / "f32"), ids)
    assert (restored - ref).norm() < 0.02 * ref.norm()


def test_awq_beats_rtn_on_the_outlier_model(tmp_path):
    src = tmp_path / "outlier"
    make_outlier_model(SHIPPED, src)
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    ids = torch.tensor([[0] + tok(VALID.read_text()[:4000], add_special_tokens=False)["input_ids"][:255]])
    ref = logits(SHIPPED, ids)
    assert torch.equal(logits(src, ids), ref)  # power-of-two factor: the same function, bit for bit
    err = {}
    for method in ("rtn", "awq"):
        model, summary = ac.quantize_model(src, tmp_path / method, method=method, bits=4, group_size=64,
                                           num_samples=4, seq_len=128, n_grid=10, progress=False)
        err[method] = (logits(model, ids) - ref).pow(2).mean().item()
    assert err["awq"] < 0.5 * err["rtn"], err
    assert list(summary["layers"][0]["alpha"]) == [  # GQA: no v_proj -> o_proj group
        "input_layernorm->self_attn.v_proj", "post_attention_layernorm->mlp.up_proj", "mlp.up_proj->mlp.down_proj"]
    with pytest.raises(ValueError, match=r"channels must be non-empty and in \[0, 256\)"):
        make_outlier_model(SHIPPED, tmp_path / "bad", channels=[256])


def test_calibration_samples_jsonl_and_seed(tmp_path):
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"text": VALID.read_text()[i:i + 3000]}) for i in range(0, 30000, 3000)))
    a = calibration_samples(tok, path, 4, 128, seed=0)
    assert a.shape == (4, 128) and (a[:, 0] == tok.bos_token_id).all()
    assert torch.equal(a, calibration_samples(tok, path, 4, 128, seed=0))
    assert not torch.equal(a, calibration_samples(tok, path, 4, 128, seed=1))


def _quantized_dir(path: Path) -> Path:
    path.mkdir()
    cfg = json.loads((SHIPPED / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": W4}))
    return path


BAD = [
    (dict(bits=3), "--bits must be 4 or 8"),
    (dict(group_size=16), "--group-size must be one of 32, 64, 128"),
    (dict(group_size=128), r"mlp\.down_proj \(weight \[256, 704\]"),
    (dict(calib_data="/nonexistent/calib.txt", group_size=64), "does not exist"),
    (dict(calib_data="SHORT", group_size=64), "fewer than --num-samples x --seq-len"),
    (dict(calib_data="NOTEXT", group_size=64), 'line 1 has no string "text" field'),
    (dict(num_samples=2, seq_len=64, group_size=64), "below the minimum of 256"),
    (dict(num_samples=256, seq_len=1, group_size=64), "--seq-len at least 8"),
    (dict(seq_len=16384, group_size=64), "exceeds the model's max_position_embeddings 8192"),
    (dict(model="QUANTIZED", group_size=64), "already quantized"),
    (dict(output="NONEMPTY", group_size=64), "exists and is not empty"),
]


@pytest.mark.parametrize("kw,message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_input_is_refused_before_loading(kw, message, tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("weights loaded before the input was checked")

    monkeypatch.setattr(ac, "load_float_model", no_load)
    (tmp_path / "short.txt").write_text("To be, or not to be.")
    (tmp_path / "notext.jsonl").write_text('{"content": "x"}\n')
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "keep.txt").write_text("mine")
    files = {"SHORT": tmp_path / "short.txt", "NOTEXT": tmp_path / "notext.jsonl", "NONEMPTY": tmp_path / "nonempty"}
    kw = {k: files.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}
    if kw.get("model") == "QUANTIZED":
        kw["model"] = _quantized_dir(tmp_path / "quantized")
    model, output = kw.pop("model", SHIPPED), kw.pop("output", tmp_path / "out")
    with pytest.raises(ValueError, match=message):
        ac.quantize_model(model, output, num_samples=kw.pop("num_samples", 4), seq_len=kw.pop("seq_len", 64), **kw)
    assert (tmp_path / "nonempty" / "keep.txt").read_text() == "mine"


def test_cli_quantize_end_to_end(tiny, calib, tmp_path, capsys):
    out = tmp_path / "w4"
    assert cli.main(["quantize", "--model", str(tiny), "--output", str(out), "--bits", "4", "--group-size", "32",
                     "--calib-data", str(calib), "--num-samples", "4", "--seq-len", "64", "--seed", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"] == W4
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["calib_tokens"] == 256
    assert cli.main(["quantize", "--model", str(tiny), "--output", str(tmp_path / "rtn8"), "--method", "rtn",
                     "--bits", "8"]) == 0
    assert json.loads((tmp_path / "rtn8" / "config.json").read_text())["quantization_config"] == W8
    assert cli.main(["quantize", "--output", str(tmp_path / "bad"), "--group-size", "128"]) == 2
    assert "mlp.down_proj" in capsys.readouterr().err


@pytest.mark.parametrize("widths,group", [((256, 704), 64), ((256, 512), 128), ((96, 160), 32)])
def test_an_unset_group_size_is_128_or_the_largest_that_fits(widths, group):
    hidden, inter = widths
    shapes = {"self_attn.q_proj": (hidden, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    opts = ac.QuantizeOptions(method="rtn")
    ac.check_shapes(shapes, opts)
    assert opts.group_size == group


def test_the_cli_quantizes_the_shipped_model_with_its_defaults(tmp_path):
    from tokenmill.entrypoints.cli import main

    assert main(["quantize", "--output", str(tmp_path / "q"), "--method", "rtn"]) == 0
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 64 and qc["bits"] == 4  # 704-wide MLP: 128 does not divide it
