"""A corrupt, truncated or mismatched checkpoint stops the load with a ValueError naming the tensor or file: it
must never load into a model that gives wrong tokens."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.config import EngineConfig
from conftest import make_llm

WEIGHTS = "model.safetensors"


@pytest.fixture
def copy(llama_dir, tmp_path):
    """A copy of the tiny Llama whose weights (a dict) and config the test may change before loading."""
    dst = tmp_path / "model"
    shutil.copytree(llama_dir, dst)

    def edit(weights=None, config=None):
        if weights is not None:
            tensors = load_file(str(dst / WEIGHTS))
            weights(tensors)
            save_file(tensors, str(dst / WEIGHTS))
        if config is not None:
            cfg = json.loads((dst / "config.json").read_text())
            config(cfg)
            (dst / "config.json").write_text(json.dumps(cfg))
        return str(dst)
    return edit


def _set(name, value):
    return lambda t: t.__setitem__(name, value(t[name]))


@pytest.mark.parametrize("piece", ["self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.gate_proj"])
def test_a_missing_piece_of_a_merged_projection_is_named(copy, piece):
    """q/k/v and gate/up load into one parameter each: any one of their pieces used to mark it loaded, and a
    missing one left its rows as torch.empty made them (different garbage each run)."""
    name = f"model.layers.0.{piece}.weight"
    with pytest.raises(ValueError, match=f"missing weights: {name}"):
        make_llm(copy(weights=lambda t: t.pop(name)))


def test_layers_past_the_configs_count_are_refused(copy):
    """A checkpoint with more layers than num_hidden_layers says so (they were skipped as another pipeline
    stage's, and the model ran short)."""
    with pytest.raises(ValueError, match=r"model\.layers\.1\..*num_hidden_layers"):
        make_llm(copy(config=lambda c: c.update(num_hidden_layers=1)))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_values_for_a_float_weight_are_refused(copy, dtype):
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"{name}.*dtype mismatch"):
        make_llm(copy(weights=_set(name, lambda w: w.to(dtype))))


@pytest.mark.parametrize("rows", [600, 500])
def test_an_embedding_of_another_vocabulary_size_is_refused(copy, rows):
    """More rows than vocab_size were cut silently (on a tied model, the LM head's rows too); fewer were a raw
    torch error."""
    name = "model.embed_tokens.weight"

    def resize(w):
        return torch.cat([w, w])[:rows]
    with pytest.raises(ValueError, match=f"{name}.*shape mismatch"):
        make_llm(copy(weights=_set(name, resize)))


def test_a_nan_weight_is_refused(copy):
    """One NaN made every token id 0, sampled or greedy, with no error."""
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(w):
        w = w.clone()
        w[3, 5] = float("nan")
        return w
    with pytest.raises(ValueError, match=f"{name}.*NaN"):
        make_llm(copy(weights=_set(name, poison)))


def test_truncated_and_garbled_files_name_the_file(copy):
    path = copy()
    data = open(f"{path}/{WEIGHTS}", "rb").read()
    open(f"{path}/{WEIGHTS}", "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated"):
        make_llm(path)
    open(f"{path}/{WEIGHTS}", "wb").write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(ValueError, match="model.safetensors: corrupt or truncated"):
        make_llm(path)


def test_shards_and_their_index(copy):
    """A tensor in two shards (the last copy silently won) and an index that is not one."""
    path = copy()
    tensors = load_file(f"{path}/{WEIGHTS}")
    names = sorted(tensors)
    first = {n: tensors[n] for n in names[: len(names) // 2]}
    second = {n: tensors[n] for n in names[len(names) // 2:]}
    second[names[0]] = torch.zeros_like(tensors[names[0]])  # a stray copy
    save_file(first, f"{path}/a.safetensors")
    save_file(second, f"{path}/b.safetensors")
    import os
    os.remove(f"{path}/{WEIGHTS}")
    index = {"weight_map": {**{n: "a.safetensors" for n in first}, **{n: "b.safetensors" for n in second}}}
    with open(f"{path}/model.safetensors.index.json", "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match=f"{names[0]}.*also in another file"):
        make_llm(path)
    with open(f"{path}/model.safetensors.index.json", "w") as f:
        f.write('{"metadata": {}}')
    with pytest.raises(ValueError, match="weight_map"):
        make_llm(path)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(num_attention_heads="4"), "config.json"),
    (lambda c: c.update(rope_scaling={"rope_type": "llama3"}), "config.json"),
])
def test_bad_config_values_name_the_file(copy, change, message):
    with pytest.raises(ValueError, match=message):
        make_llm(copy(config=change))


@pytest.mark.parametrize("kw,field", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens"),
    (dict(max_model_len=-1), "max_model_len"), (dict(max_model_len=0), "max_model_len"),
    (dict(kv_cache_memory_gb=0), "kv_cache_memory_gb"), (dict(kv_cache_memory_gb=-1.0), "kv_cache_memory_gb"),
    (dict(num_threads=0), "num_threads"), (dict(seed=None), "seed"), (dict(seed=2**70), "seed"),
    (dict(max_num_seqs=4, max_model_len="64"), "max_model_len"), (dict(block_size=16.0), "block_size"),
    (dict(block_size=24), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs="4"), "max_num_seqs"), (dict(tensor_parallel_size=1.5), "tensor_parallel_size"),
])
def test_engine_sizes_that_would_hang_or_fail_in_torch_are_refused(llama_dir, kw, field):
    """max_num_batched_tokens=0 was accepted, and then no step ever scheduled anything (generate hung); the
    others failed deep in torch or meant something else silently (kv_cache_memory_gb=0 meant 4 GiB)."""
    with pytest.raises(ValueError, match=field):
        EngineConfig(model=llama_dir, **kw)


def test_a_tokenizer_directory_that_is_not_there_or_does_not_load(llama_dir, tmp_path):
    from tokenmill.tokenizer import load_tokenizer

    with pytest.raises(ValueError, match="tokenizer directory not found"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="tokenizer directory not found"):
        EngineConfig(model=llama_dir, tokenizer=str(tmp_path / "nope"))
    (tmp_path / "tokenizer.json").write_text("{ not json")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        load_tokenizer(str(tmp_path))


def test_an_image_token_outside_the_vocabulary_is_refused_at_startup():
    """It was accepted, and every image request then failed with a message about placeholders."""
    from llava_fixtures import IMAGE_TOKEN, llava_config
    from tokenmill.config import ModelConfig

    cfg = llava_config("llama")
    assert ModelConfig.from_hf(cfg).image_token_id == IMAGE_TOKEN
    cfg.image_token_index = 10**6
    with pytest.raises(ValueError, match="image_token_index 1000000"):
        ModelConfig.from_hf(cfg)


def test_a_broken_tokenizer_fails_before_the_weights_load(copy, monkeypatch):
    """The offline engine loaded the weights first (minutes for a large model), then found the tokenizer broken."""
    from tokenmill.engine import llm_engine

    path = copy()
    with open(f"{path}/tokenizer.json", "w") as f:
        f.write("{ truncated")

    def no_core(*a, **kw):
        raise AssertionError("the weights were loaded before the tokenizer")
    monkeypatch.setattr(llm_engine, "EngineCore", no_core)
    with pytest.raises(ValueError, match="cannot load the tokenizer"):
        make_llm(path)
