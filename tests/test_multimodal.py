"""LLaVA-style models: numerics against transformers, the encoder cache, image-keyed prefix caching,
encoder budget and overlap, and bad input."""
import pytest
import torch

from tokenmill import SamplingParams
from conftest import make_llm, random_prompts
from llava_fixtures import IMAGE_TOKEN, TOKENS_PER_IMAGE, build_llava, expand, hf_greedy_mm, hf_pixels, random_image

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    """text model -> (path, transformers model)."""
    out = {}
    for text in ("llama", "qwen2"):
        path = str(tmp_path_factory.mktemp(f"llava-{text}"))
        out[text] = (path, build_llava(path, text))
    return out


def mm_prompt(seed: int, lengths: list[int]) -> list[int]:
    """Random text pieces with one image token between consecutive pieces."""
    pieces = random_prompts(lengths, seed=seed, vocab=IMAGE_TOKEN)
    ids = pieces[0]
    for p in pieces[1:]:
        ids = ids + [IMAGE_TOKEN] + p
    return ids


@pytest.mark.parametrize("text", ["llama", "qwen2"])
def test_logits_match_transformers_with_one_and_two_images(llava_dirs, text):
    path, hf = llava_dirs[text]
    llm = make_llm(path)
    for n_images in (1, 2):
        images = [random_image(10 + i) for i in range(n_images)]
        ids = mm_prompt(n_images, [5] + [7] * n_images)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        full = expand(ids)
        assert out.prompt_token_ids == full
        with torch.no_grad():
            ref = hf(torch.tensor([full]), pixel_values=hf_pixels(path, images)).logits[0].float().log_softmax(-1)
        ours = torch.tensor([out.prompt_logprobs[i][full[i]].logprob for i in range(1, len(full))])
        torch.testing.assert_close(ours, ref[torch.arange(len(full) - 1), torch.tensor(full[1:])], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("text", ["llama", "qwen2"])
def test_greedy_matches_transformers_generate(llava_dirs, text):
    path, hf = llava_dirs[text]
    llm = make_llm(path)
    cases = [(mm_prompt(3, [6, 9]), [random_image(1)]), (mm_prompt(4, [3, 5, 11]), [random_image(2), random_image(3)])]
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}} for ids, imgs in cases],
                        GREEDY, use_tqdm=False)
    for (ids, imgs), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, imgs), 12)
    llm.llm_engine.check_invariants()


def test_image_inside_a_chunked_prefill_gives_the_same_tokens(llava_dirs):
    """A 7-token budget cuts the prompt, and the images' placeholder runs, across several steps."""
    path, hf = llava_dirs["llama"]
    ids, imgs = mm_prompt(5, [9, 4, 6]), [random_image(4), random_image(5)]
    llm = make_llm(path, max_num_batched_tokens=TOKENS_PER_IMAGE, mm_encoder_budget=TOKENS_PER_IMAGE,
                   enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, imgs), 12)
    llm.llm_engine.check_invariants()


def test_deeper_feature_layer_list_matches_transformers(tmp_path):
    path = str(tmp_path / "llava-layers")
    hf = build_llava(path, "llama", seed=3, feature_layer=[-3, -1])
    llm = make_llm(path)
    ids, imgs = mm_prompt(6, [4, 8]), [random_image(6)]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, imgs), 12)
