"""LLaVA-style models: numerics against transformers, the encoder cache, image-keyed prefix caching,
encoder budget and overlap, and bad input."""
import pytest
import torch

from tokenmill import SamplingParams
from conftest import VOCAB, make_llm, random_prompts
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
    pieces = [[t + 1 for t in p] for p in random_prompts(lengths, seed=seed, vocab=VOCAB - 1)]  # never id 3
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


def test_the_same_image_twice_in_one_prompt_is_encoded_once(llava_dirs):
    path, hf = llava_dirs["qwen2"]
    llm = make_llm(path)
    ids, img = mm_prompt(12, [3, 5, 4]), random_image(12)
    out = llm.generate(_req(ids, [img, img.copy()]), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, [img, img]), 12)
    assert llm.llm_engine.core.runner.encoder.images_encoded == 1
    llm.llm_engine.check_invariants()


def test_deeper_feature_layer_list_matches_transformers(tmp_path):
    path = str(tmp_path / "llava-layers")
    hf = build_llava(path, "llama", seed=3, feature_layer=[-3, -1])
    llm = make_llm(path)
    ids, imgs = mm_prompt(6, [4, 8]), [random_image(6)]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, imgs), 12)


def _req(ids, imgs):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}


def test_encoder_cache_and_image_keyed_prefix_blocks(llava_dirs):
    """The same image twice: encoded once, its blocks reused, same tokens. A different image with the same
    text: different tokens, and no block at or after the image is shared."""
    path, hf = llava_dirs["llama"]
    llm = make_llm(path, block_size=4)
    ids = mm_prompt(7, [10, 12])  # image placeholders at 10 .. 25
    a, b = random_image(20), random_image(21)
    first = llm.generate(_req(ids, [a]), GREEDY, use_tqdm=False)[0]
    enc = llm.llm_engine.core.runner.encoder
    assert enc.images_encoded == 1
    again = llm.generate(_req(ids, [a.copy()]), GREEDY, use_tqdm=False)[0]
    assert enc.images_encoded == 1  # an encoder cache hit by pixel hash
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens >= 10 + TOKENS_PER_IMAGE  # the image's blocks are prefix hits
    other = llm.generate(_req(ids, [b]), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 8  # only whole blocks before the image (10 tokens -> 2 blocks of 4)
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert other.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, [b]), 12)
    assert enc.images_encoded == 2
    stats = llm.llm_engine.get_stats()
    assert (stats.mm_images_encoded, stats.mm_encoder_cache_misses) == (2, 2)
    assert stats.mm_encoder_seconds > 0
    llm.llm_engine.check_invariants()


def test_encoder_cache_hit_gives_the_same_tokens_without_prefix_caching(llava_dirs):
    path, _ = llava_dirs["qwen2"]
    llm = make_llm(path, enable_prefix_caching=False)
    img = random_image(30)
    prompts = [_req(mm_prompt(s, [4, 6]), [img]) for s in (8, 9)]  # different text, same image
    separate = [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert llm.llm_engine.core.runner.encoder.images_encoded == 1
    fresh = make_llm(path, enable_prefix_caching=False)
    assert [fresh.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[::-1]] == separate[::-1]
    baseline = make_llm(path, enable_prefix_caching=False, mm_encoder_cache=False)  # the ladder's naive rung
    assert [baseline.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts] == separate
    assert baseline.llm_engine.core.runner.encoder.images_encoded == 2
    baseline.llm_engine.check_invariants()


@pytest.mark.parametrize("overlap, async_scheduling", [(True, False), (False, False), (True, True)])
def test_many_requests_with_and_without_overlap_match_one_at_a_time(llava_dirs, overlap, async_scheduling):
    """Requests arriving while others decode: with overlap their images are encoded in the encoder thread;
    the tokens are those of each request run alone. With async scheduling too (a GPU's default), steps are
    scheduled while the one before is in flight."""
    path, _ = llava_dirs["llama"]
    imgs = [random_image(40 + i) for i in range(6)]
    prompts = [_req(mm_prompt(50 + i, [3 + i, 5]), [imgs[i % 4]]) for i in range(6)]
    alone = make_llm(path, mm_encoder_overlap=False)
    expected = [alone.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(path, mm_encoder_overlap=overlap, max_num_seqs=3, mm_encoder_budget=TOKENS_PER_IMAGE,
                   mm_encoder_cache_tokens=4 * TOKENS_PER_IMAGE, max_num_batched_tokens=32,
                   async_scheduling=async_scheduling)
    engine = llm.llm_engine
    ids = [engine.add_request(None, prompts[0], GREEDY)]
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps in (2, 3, 5, 6, 8):  # arrivals while the first requests decode
            ids.append(engine.add_request(None, prompts[len(ids)], GREEDY))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 9 and len(ids) < len(prompts):
            ids.append(engine.add_request(None, prompts[len(ids)], GREEDY))
    assert [done[i] for i in ids] == expected
    engine.check_invariants()
    enc = engine.core.runner.encoder
    assert enc.images_encoded >= 4  # the cache holds 4 images: at least each distinct one once
    assert (enc.images_prefetched > 0) == overlap
    assert (engine.core.scheduler.encoder.cache.used <= 4 * TOKENS_PER_IMAGE)
    assert (engine.core.scheduler.num_run_ahead > 0) == async_scheduling


def test_text_prompt_with_image_and_video_markers(llava_dirs):
    """'<image>' is one image; '<video>' becomes one image per sampled frame, in prompt order."""
    path, hf = llava_dirs["llama"]
    llm = make_llm(path, mm_video_num_frames=2)
    tok = llm.get_tokenizer()
    img, clip = random_image(60), [random_image(61 + i) for i in range(5)]  # 5 frames -> frames 0 and 4 (or so)
    out = llm.generate({"prompt": "To be <video> or not <image> to be",
                        "multi_modal_data": {"image": img, "video": clip}}, GREEDY, use_tqdm=False)[0]
    from tokenmill.multimodal.video import load_video
    frames = load_video(clip, 2, 10**8)
    ids = tok.encode("To be <image><image> or not <image> to be")
    assert out.prompt_token_ids == expand(ids)
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, [*frames, img]), 12)


@pytest.mark.parametrize("prompt, data, message", [
    ({"prompt_token_ids": [5, IMAGE_TOKEN, 6]}, {}, "1 image placeholder token(s) but 0"),
    ({"prompt_token_ids": [5, IMAGE_TOKEN, 6]}, {"image": [random_image(1)] * 2}, "but 2 image(s)"),
    ({"prompt": "two <image> <image>"}, {"image": random_image(1)}, "2 <image>"),
    ({"prompt_token_ids": [5] + [IMAGE_TOKEN] * 5}, {"image": [random_image(1)] * 5}, "at most 4 images"),
    ({"prompt_token_ids": [5, IMAGE_TOKEN]}, {"image": b"not an image at all"}, "could not decode image"),
    ({"prompt_token_ids": [5, IMAGE_TOKEN]}, {"image": random_image(1, size=(300, 300))}, "pixel"),
    ({"prompt_token_ids": [5, IMAGE_TOKEN]}, {"audio": b"x"}, "unsupported multi_modal_data"),
])
def test_bad_multimodal_input_is_refused_and_the_engine_keeps_serving(llava_dirs, prompt, data, message):
    path, hf = llava_dirs["llama"]
    llm = make_llm(path, mm_max_image_pixels=200 * 200)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llm.generate({**prompt, "multi_modal_data": data} if data else prompt, GREEDY, use_tqdm=False)
    ids, imgs = mm_prompt(70, [4, 4]), [random_image(70)]
    out = llm.generate(_req(ids, imgs), GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy_mm(hf, expand(ids), hf_pixels(path, imgs), 12)
    llm.llm_engine.check_invariants()


def test_text_model_refuses_images(model_dirs):
    llm = make_llm(model_dirs["llama"][0])
    with pytest.raises(ValueError, match="takes no images"):
        llm.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": random_image(1)}}, use_tqdm=False)


@pytest.mark.parametrize("kw, message", [
    ({"mm_encoder_budget": TOKENS_PER_IMAGE - 1}, "below one image"),
    # a prompt with more image rows than the budget waited for ever without chunked prefill
    ({"mm_encoder_budget": TOKENS_PER_IMAGE, "enable_chunked_prefill": False}, "without chunked prefill"),
    ({"mm_encoder_cache_tokens": TOKENS_PER_IMAGE}, "at least two steps"),
    ({"limit_mm_per_prompt": '{"audio": 1}'}, "limit_mm_per_prompt"),
    ({"speculative_config": {"method": "draft_model", "model": "x", "num_speculative_tokens": 2}}, "draft model"),
])
def test_bad_multimodal_settings_are_refused(llava_dirs, kw, message):
    with pytest.raises(ValueError, match=message):
        make_llm(llava_dirs["llama"][0], **kw)


def test_a_waiting_image_is_encoded_while_async_steps_schedule_nothing(llava_dirs):
    """Async scheduling with one seat: a penalized request cannot run ahead, so every other schedule is empty
    while its step is in flight; the image of the request waiting behind it is ordered to the encoder thread
    in such a schedule. Those orders used to be dropped (the empty step returned first): the waiting request
    then never got its image and the engine spun forever."""
    path, _ = llava_dirs["llama"]
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=0.5)
    first, waiting = _req(mm_prompt(70, [4, 5]), [random_image(71)]), _req(mm_prompt(72, [3, 6]), [random_image(73)])
    alone = make_llm(path, mm_encoder_overlap=False)
    expected = [alone.generate(first, penalized, use_tqdm=False)[0].outputs[0].token_ids,
                alone.generate(waiting, GREEDY, use_tqdm=False)[0].outputs[0].token_ids]
    for arrival in (3, 4):  # the step after which the second request arrives: one of them is an empty schedule
        llm = make_llm(path, max_num_seqs=1, mm_encoder_overlap=True, async_scheduling=True)
        engine = llm.llm_engine
        ids, done = [engine.add_request(None, first, penalized)], {}
        for step in range(500):  # a few dozen steps are enough; a lost order spins forever
            if step == arrival:
                ids.append(engine.add_request(None, waiting, GREEDY))
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            if len(ids) == 2 and not engine.has_unfinished_requests():
                break
        assert [done.get(i) for i in ids] == expected, arrival
        assert engine.core.runner.encoder.images_prefetched > 0  # the waiting image went to the encoder thread
        engine.check_invariants()


@pytest.mark.parametrize("reuse, overlap", [(False, False), (True, False), (True, True)])
def test_shared_images_under_preemption_and_chunking_match_one_at_a_time(llava_dirs, reuse, overlap):
    """A small KV pool (preemptions), a small budget (chunks through images) and two images shared by eight
    requests, with and without encoder-cache reuse and overlap: every request gets its tokens as if alone."""
    path, _ = llava_dirs["llama"]
    imgs = [random_image(80), random_image(81)]
    prompts = [_req(mm_prompt(90 + i, [2 + i, 6]), [imgs[i % 2]]) for i in range(8)]
    alone = make_llm(path, max_model_len=48)
    expected = [alone.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(path, mm_encoder_cache=reuse, mm_encoder_overlap=overlap, enable_prefix_caching=False,
                   max_num_batched_tokens=20, mm_encoder_budget=TOKENS_PER_IMAGE, num_kv_blocks=14, block_size=4,
                   max_model_len=48)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.llm_engine.get_stats().num_preemptions > 0
    llm.llm_engine.check_invariants()


def test_truncate_prompt_tokens_counts_each_images_placeholder_tokens(llava_dirs):
    """The limit was checked before each image became its placeholder run: a prompt held to 20 tokens ran with
    27. A prompt with images that does not fit is refused (a cut could split an image from its run); one that
    fits runs as it is."""
    path, _ = llava_dirs["llama"]
    llm = make_llm(path)
    ids, imgs = mm_prompt(3, [4, 3]), [random_image(3)]  # 7 text tokens + 1 image marker
    full = len(expand(ids))
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=len(ids) + 2)
    assert len(ids) + 2 < full
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate(_req(ids, imgs), sp, use_tqdm=False)
    fits = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=full)
    out = llm.generate(_req(ids, imgs), fits, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) == full
    llm.llm_engine.check_invariants()


def test_16_bit_grey_images_are_scaled_not_clipped_to_white():
    """A 16-bit PNG opens as I;16 (or I): PIL's RGB conversion clips its values at 255, so nearly every pixel came
    out white. It is scaled to 8 bits, as the same picture saved in 8 bits reads."""
    import io

    import numpy as np
    from PIL import Image

    from tokenmill.multimodal.image import to_rgb

    grey = np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000
    eight = Image.fromarray(np.round(grey / 257).astype(np.uint8), "L")
    want = np.asarray(eight.convert("RGB"))
    assert np.array_equal(np.asarray(to_rgb(Image.fromarray(grey))), want)  # I;16
    buf = io.BytesIO()
    Image.fromarray(grey).save(buf, format="PNG")
    assert np.array_equal(np.asarray(to_rgb(Image.open(io.BytesIO(buf.getvalue())))), want)  # as a PNG reads
    assert np.array_equal(np.asarray(to_rgb(eight)), want)  # 8-bit grey unchanged


def _fail_once(owner, name: str, when=lambda *a: True):
    """`owner.name` raises RuntimeError("injected failure") the first time `when(*args)` holds; returns a
    list that records that it did."""
    real, fired = getattr(owner, name), []

    def flaky(*args, **kw):
        if not fired and when(*args):
            fired.append(True)
            raise RuntimeError("injected failure")
        return real(*args, **kw)
    setattr(owner, name, flaky)
    return fired


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("where", ["encode", "prepare", "prefetch", "schedule"])
def test_the_engine_carries_on_after_a_failed_step_that_was_to_encode_an_image(llava_dirs, where, async_scheduling):
    """A step that was to encode an image fails (the encoder raised; or the step failed before the worker
    heard of the image; or, with overlap, the encoder thread raised; or the schedule raised after planning the
    encode). The scheduler's ledger of the encoder cache said the image was cached (or pending for ever):
    every later step that needed its rows failed, or its request waited for ever. A caller that carries on
    gets the tokens of a run without the failure."""
    path, _ = llava_dirs["llama"]
    prompts = [_req(mm_prompt(110 + i, [3 + i, 5]), [random_image(111 + i)]) for i in range(3)]
    alone = make_llm(path, mm_encoder_overlap=False)
    expected = [alone.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(path, mm_encoder_overlap=where == "prefetch", max_num_seqs=2, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    runner, sched = engine.core.runner, engine.core.scheduler
    if where == "encode":
        fired = _fail_once(runner.encoder, "_encode")
    elif where == "prepare":
        fired = _fail_once(runner, "prepare_batch", lambda seqs, *a: any(s.num_new_tokens > 1 for s in seqs))
    elif where == "prefetch":  # the third request waits for a seat: its image goes to the encoder thread
        fired = _fail_once(runner.encoder, "_encode", lambda items: items[0].hash == engine_hash[0])
    else:
        fired = _fail_once(sched, "_plan_drafts", lambda scheduled: sched.encoder._step_items)
    ids, done, engine_hash = [], {}, []
    for p in prompts:
        ids.append(engine.add_request(None, p, GREEDY))
    engine_hash.append(sched.requests[ids[2]].mm_items[0].hash)
    for _ in range(300):
        try:
            outs = engine.step()
        except RuntimeError as e:
            assert "injected failure" in str(e)
            continue
        done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert fired
    assert [done.get(i) for i in ids] == expected
    engine.check_invariants()
