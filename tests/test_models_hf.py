"""Numerics against Hugging Face transformers on tiny random float32 models."""
import pytest
import torch

from tokenmill import SamplingParams
from conftest import hf_greedy, make_llm, random_prompts

# one-token prompt, prompts ending exactly on block boundaries (16, 32), and ragged lengths
LENGTHS = [1, 7, 16, 23, 32, 45]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "llama-in-slices"])
def test_prompt_logprobs_match_transformers(model_dirs, arch, monkeypatch):
    if arch == "llama-in-slices":  # the logits of 7 prompt rows at a time (a chunk's whole would not fit a GPU)
        from tokenmill.worker import model_runner
        monkeypatch.setattr(model_runner, "PROMPT_LOGPROB_ROWS", 7)
    path, hf = model_dirs[arch.split("-")[0]]
    llm = make_llm(path)
    prompts = random_prompts([40, 17], seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        ours = torch.tensor([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
        expected = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers_generate(model_dirs, arch):
    path, hf = model_dirs[arch]
    llm = make_llm(path)
    prompts = random_prompts(LENGTHS, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        # (the llama model's argmax is EOS once in these prompts: ignore_eos keeps it, as the reference does)
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 24, suppress_eos=False), f"prompt length {len(p)}"
        assert out.outputs[0].finish_reason == "length"
    llm.llm_engine.check_invariants()


def test_text_prompt_matches_transformers(model_dirs):
    path, hf = model_dirs["llama"]
    llm = make_llm(path)
    tok = llm.get_tokenizer()
    prompt = "To be, or not to be"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    ids = tok.encode(prompt)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 12)
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_bfloat16_runs_close_to_float32(llama_dir):
    prompts = random_prompts([20], seed=3)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    f32 = make_llm(llama_dir).generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)[0]
    b16 = make_llm(llama_dir, dtype="bfloat16").generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                         use_tqdm=False)[0]
    a = torch.tensor([d[prompts[0][i + 1]].logprob for i, d in enumerate(f32.prompt_logprobs[1:])])
    b = torch.tensor([d[prompts[0][i + 1]].logprob for i, d in enumerate(b16.prompt_logprobs[1:])])
    assert (a - b).abs().max() < 0.25


def test_sharded_checkpoint_loads(model_dirs, tmp_path):
    import os
    import shutil

    path, hf = model_dirs["qwen2"]
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(path, f), tmp_path / f)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    prompt = random_prompts([11], seed=4)[0]
    out = make_llm(str(tmp_path)).generate({"prompt_token_ids": prompt},
                                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                           use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("tp", [1, 2])
def test_llama_with_attention_and_mlp_biases_matches_transformers(tmp_path, tp):
    """Llama's attention_bias biases o_proj too, and mlp_bias the MLP's three projections: such checkpoints
    failed to load (o_proj.bias had no parameter). Greedy tokens and prompt logprobs as transformers gives them,
    on the default CPU path (one-call decode step) and split over two tensor-parallel ranks (the row-parallel
    biases added once)."""
    from conftest import SHAPE, _llama, save_random_model
    hf = save_random_model(str(tmp_path), _llama(**SHAPE, head_dim=32, attention_bias=True, mlp_bias=True))
    llm = make_llm(str(tmp_path), tensor_parallel_size=tp, **({"allow_cpu_oversubscription": True} if tp > 1 else {}))
    prompts = random_prompts([1, 19, 33], seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 12, suppress_eos=False)
        if len(p) > 1:
            with torch.no_grad():
                ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
            ours = torch.tensor([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
            torch.testing.assert_close(ours, ref[torch.arange(len(p) - 1), torch.tensor(p[1:])], atol=1e-4, rtol=1e-4)
