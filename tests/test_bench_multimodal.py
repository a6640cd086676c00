"""Multimodal benchmarks: the random-mm workload (valid PNG / GIF data URIs, the distinct-image pool, the
video share), `bench offline` on a tiny LLaVA with its multimodal block, and the multimodal ladder."""
import argparse
import base64
import io
import json

import pytest
from PIL import Image

from llava_fixtures import TOKENS_PER_IMAGE, build_llava
from tokenmill.bench.cli import add_bench_parser, main as bench_main
from tokenmill.bench.datasets import RandomMMDataset, dataset_from_args, get_tokenizer, sample_requests
from tokenmill.bench.ladder import MULTIMODAL_RUNGS, SCENARIOS, ladder_configs, run_ladder
from tokenmill.bench.report import validate_ladder
from tokenmill.config import DEFAULT_MODEL

# conftest's template prints a list content as it is; LLaVA templates put an image token per image part
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n"
                 "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
                 "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MM_KEYS = {"images", "images_per_s", "images_encoded", "images_prefetched", "encoder_seconds", "encoder_cache_hits",
           "encoder_cache_misses"}


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("llava-bench"))
    build_llava(path, "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


def _decode(part: dict) -> Image.Image:
    url = part[part["type"]]["url"]
    header, data = url.split(",", 1)
    assert header in ("data:image/png;base64", "data:image/gif;base64")
    img = Image.open(io.BytesIO(base64.b64decode(data)))
    img.load()
    assert img.format == ("PNG" if "png" in header else "GIF")
    return img


def test_random_mm_sampling():
    tok = get_tokenizer(DEFAULT_MODEL)
    ds = RandomMMDataset(input_len=12, output_len=5, images_per_request=2, image_size="40x30", num_distinct_images=3,
                         video_fraction=0.25, video_frames=3)
    reqs = sample_requests(ds, 12, tok, seed=1)
    special = set(tok.all_special_ids)
    videos = [r for r in reqs if r.multi_modal_data[0]["type"] == "video_url"]
    assert len(videos) == 3
    urls = set()
    for r in reqs:
        assert len(r.prompt) == r.prompt_len == 12 and not special & set(r.prompt) and r.expected_output_len == 5
        if r in videos:
            assert len(r.multi_modal_data) == 1
            gif = _decode(r.multi_modal_data[0])
            assert gif.n_frames == 3 and gif.size == (40, 30)
        else:
            assert [p["type"] for p in r.multi_modal_data] == ["image_url"] * 2
            assert all(_decode(p).size == (40, 30) for p in r.multi_modal_data)
            urls |= {p["image_url"]["url"] for p in r.multi_modal_data}
    assert len(urls) <= 3  # drawn from the pool
    again = sample_requests(ds, 12, tok, seed=1)
    assert [r.multi_modal_data for r in again] == [r.multi_modal_data for r in reqs]
    distinct = sample_requests(RandomMMDataset(4, 2, image_size="16x16"), 6, None, seed=2)
    assert len({r.multi_modal_data[0]["image_url"]["url"] for r in distinct}) == 6
    assert all(isinstance(r.prompt, str) for r in distinct)
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        RandomMMDataset(image_size="big")
    with pytest.raises(ValueError, match="video-fraction"):
        RandomMMDataset(video_fraction=1.5)


def test_bench_serve_refuses_random_mm_without_chat():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--dataset-name", "random-mm"])
    with pytest.raises(SystemExit, match="--endpoint chat"):
        dataset_from_args(args)
    for flags in (["--endpoint", "chat"], ["--endpoint", "/v1/chat/completions"], ["--backend", "openai-chat"]):
        args = parser.parse_args(["bench", "serve", "--dataset-name", "random-mm", "--mm-image-size", "8x8", *flags])
        assert isinstance(dataset_from_args(args), RandomMMDataset)


def test_bench_offline_reports_the_multimodal_block(llava_dir, tmp_path):
    out = tmp_path / "mm.json"
    rc = bench_main(["offline", "--model", llava_dir, "--dtype", "float32", "--max-model-len", "256",
                     "--dataset-name", "random-mm", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                     "--mm-image-size", "24x20", "--mm-num-distinct-images", "2", "--mm-video-fraction", "0.25",
                     "--mm-video-frames", "3", "--mm-video-num-frames", "2", "--ignore-eos", "--disable-tqdm",
                     "--result-file", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    mm = res["multimodal"]
    assert set(mm) == MM_KEYS
    assert res["completed"] == 4 and mm["images"] == 3 + 2  # three one-image requests, one video of 2 sampled frames
    assert 1 <= mm["images_encoded"] <= 5 and mm["images_per_s"] > 0 and mm["encoder_seconds"] > 0
    assert mm["encoder_cache_hits"] + mm["encoder_cache_misses"] >= mm["images_encoded"]
    assert all(n > TOKENS_PER_IMAGE for n in res["input_lens"])  # the engine's prompt, placeholders included
    assert res["dataset"]["dataset_name"] == "random-mm" and res["dataset"]["mm_image_size"] == "24x20"


def test_multimodal_rungs_add_one_lever_each():
    cfgs = [c for _, _, c in ladder_configs({"model": "m"}, SCENARIOS["multimodal"])]
    assert cfgs[0] == {"model": "m", "mm_encoder_cache": False, "mm_encoder_overlap": False,
                       "enable_prefix_caching": False}
    for before, after, (_, _, delta) in zip(cfgs, cfgs[1:], MULTIMODAL_RUNGS[1:]):
        assert {k for k in after if after[k] != before.get(k)} == set(delta)
    assert cfgs[3]["mm_encoder_quantization"] == "w8a8" and not cfgs[3]["enable_prefix_caching"]
    assert cfgs[-1]["enable_prefix_caching"]


def test_multimodal_ladder_end_to_end(llava_dir, tmp_path):
    out = tmp_path / "mm_ladder.json"
    ladder = run_ladder(llava_dir, str(out), "multimodal", dict(
        num_prompts=5, request_rate=50.0, input_len=8, output_len=4, mm_image_size="24x20", mm_num_distinct_images=2),
        max_model_len=None, max_num_seqs=4)
    validate_ladder(json.loads(out.read_text()))
    rungs = ladder["rungs"]
    assert [r["name"] for r in rungs] == [n for n, _, _ in MULTIMODAL_RUNGS]
    for r in rungs:
        assert r["failed_requests"] == 0 and r["output_throughput"] > 0 and set(r["multimodal"]) == MM_KEYS
        assert r["multimodal"]["images"] == 5 and len(r["same_greedy_text_by_request"]) == 5
        assert r["output_throughput_vs_baseline"] > 0 and r["images_per_s_vs_baseline"] > 0
    assert rungs[0]["output_throughput_vs_baseline"] == 1.0
    assert all(r["same_greedy_text_as_baseline"] for r in rungs[:3])
    assert rungs[3]["lossy"] and not rungs[0]["lossy"]  # int8: recorded either way, never a failure
    assert rungs[4]["same_greedy_text_by_request"] == rungs[3]["same_greedy_text_by_request"]  # prefix hits: exact
    # no reuse: an image is encoded again unless a running request still holds it; with the cache, once
    encoded = [r["multimodal"]["images_encoded"] for r in rungs]
    assert encoded[0] >= encoded[1] and encoded[1] <= 2
    assert rungs[0]["multimodal"]["images_prefetched"] == rungs[1]["multimodal"]["images_prefetched"] == 0
