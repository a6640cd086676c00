"""Shared fixtures: tiny random float32 models in Hugging Face format, with a small byte-level BPE
tokenizer, for checking tokenmill against transformers."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 512
CORPUS = (
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "Héllo wörld! Ça va? 你好，世界。 こんにちは 🙂🎉 naïve café — “quotes” ‘single’ … "
) * 20


def build_tokenizer(path: str, vocab_size: int = VOCAB, extra_specials: tuple[str, ...] = ()) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>", *extra_specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=list(extra_specials))
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast.save_pretrained(path)


def _llama(**kw):
    from transformers import LlamaConfig
    return LlamaConfig(architectures=["LlamaForCausalLM"], **kw)


def _mistral(**kw):
    from transformers import MistralConfig
    return MistralConfig(architectures=["MistralForCausalLM"], sliding_window=None, **kw)


def _qwen2(**kw):
    from transformers import Qwen2Config
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, **kw)


SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=0, eos_token_id=1, pad_token_id=2)
ARCHS = {
    # head_dim 32 (not hidden / heads = 16): the shape the CPU's one-call decode step and fused rotary take, so
    # that the engine tests on this model run the default CPU path (worker/cpu_decode_step.py)
    "llama": lambda: _llama(**SHAPE, head_dim=32,
                            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": lambda: _mistral(**SHAPE),
    "qwen2": lambda: _qwen2(**SHAPE),
}


def save_random_model(path: str, config, seed: int = 0):
    """A random float32 model of `config` with this suite's tokenizer, saved to `path`; returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Larger-than-default weights make logits spread out, so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    build_tokenizer(path)
    return model


def build_model(path: str, arch: str, seed: int = 0):
    return save_random_model(path, ARCHS[arch](), seed)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """arch -> (path, transformers model)."""
    out = {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        out[arch] = (path, build_model(path, arch))
    return out


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"][0]


@pytest.fixture(scope="session")
def hf_llama(model_dirs):
    return model_dirs["llama"][1]


@pytest.fixture
def stop_cuts(monkeypatch):
    """Spies on the detokenizer: for each matched stop string, how many of its step's tokens came past it (> 0
    where a stop string landed inside a multi-token step: a burst, an accepted run of drafts)."""
    from tokenmill.engine import detokenizer

    cuts = []
    real_update = detokenizer.IncrementalDetokenizer.update

    def spy(self, new_token_ids, *args, **kw):
        stop = real_update(self, new_token_ids, *args, **kw)
        if stop is not None:
            cuts.append(len(new_token_ids) - self.num_used)
        return stop

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", spy)
    return cuts


def make_llm(path: str, **kw):
    from tokenmill import LLM

    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    return LLM(path, **kw)


def hf_greedy(model, prompt: list[int], n: int, suppress_eos: bool = True) -> list[int]:
    """transformers' greedy continuation: EOS suppressed (min_new_tokens=n, as the engine's min_tokens=n), or,
    with suppress_eos=False, EOS a token like any other that does not stop it (the engine's ignore_eos)."""
    if suppress_eos:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=2)
        return out[0, len(prompt):].tolist()
    ids, past, tokens = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(n):
            res = model(ids, past_key_values=past, use_cache=True)
            past, ids = res.past_key_values, res.logits[:, -1:].argmax(-1)
            tokens.append(int(ids))
    return tokens


def random_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
