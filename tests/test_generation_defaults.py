"""The model's sampling defaults (generation_config.json; vLLM's --generation-config auto): read from the model,
a directory, or nothing ("vllm"), with overrides; they fill what a request leaves unset, offline, in
`tokenmill generate` and on the server (whose max_tokens default stays within the context)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import pytest

from conftest import make_llm, random_prompts
from server_fixtures import ServerProcess, tiny_model_dir  # noqa: F401  (fixture)
from tokenmill import SamplingParams
from tokenmill.engine.generation_defaults import sampling_defaults

GEN = {"temperature": 0.0, "max_new_tokens": 6, "top_k": 20, "repetition_penalty": 1.05, "do_sample": True,
       "eos_token_id": 1}


def _with_generation_config(src: str, dst, gen: dict) -> str:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return str(dst)


def test_sampling_defaults_sources_overrides_and_errors(llama_dir, tmp_path):
    model = _with_generation_config(llama_dir, tmp_path / "m", GEN)
    want = {"temperature": 0.0, "max_tokens": 6, "top_k": 20, "repetition_penalty": 1.05}
    assert sampling_defaults(model) == want  # only the sampling keys; max_new_tokens is max_tokens
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(llama_dir, model) == want  # another directory's
    assert sampling_defaults(model, "auto", '{"temperature": 0.6, "top_p": 0.9}') == {**want, "temperature": 0.6,
                                                                                      "top_p": 0.9}
    assert sampling_defaults(model, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="unknown keys"):
        sampling_defaults(model, "auto", {"seed": 3})
    for bad in ("5", "null", "[1]"):
        with pytest.raises(ValueError, match="dict or JSON object"):
            sampling_defaults(model, "auto", bad)
    assert sampling_defaults(model, "vllm", '{"top_k": 20.0, "max_new_tokens": 8.0}') == {"top_k": 20, "max_tokens": 8}
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults(model, "auto", {"top_p": 2.0})
    with pytest.raises(ValueError, match="no generation_config.json"):
        sampling_defaults(model, str(tmp_path))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        sampling_defaults(model, str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="generation_config"):  # at startup, not at the first request
        make_llm(model, generation_config=str(tmp_path / "bad"))


def test_offline_and_cli_use_the_models_defaults_unless_told(llama_dir, tmp_path):
    model = _with_generation_config(llama_dir, tmp_path / "m", GEN)
    llm = make_llm(model)
    prompt = {"prompt_token_ids": random_prompts([9], seed=3)[0]}
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.max_tokens, default.top_k, default.repetition_penalty) == (0.0, 6, 20, 1.05)
    out = llm.generate(prompt, use_tqdm=False)[0].outputs[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, top_k=20, repetition_penalty=1.05)
    assert out.token_ids == llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out.token_ids) == 6 or out.finish_reason == "stop"
    plain = make_llm(model, generation_config="vllm").get_default_sampling_params()
    assert (plain.temperature, plain.max_tokens, plain.top_k) == (SamplingParams().temperature, 16, 0)
    res = subprocess.run([sys.executable, "-m", "tokenmill", "generate", "--model", model, "--dtype", "float32",
                          "--ignore-eos", "--json", "To be"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]) == 6  # the model's max_new_tokens
    res = subprocess.run([sys.executable, "-m", "tokenmill", "generate", "--model", model, "--dtype", "float32",
                          "--ignore-eos", "--json", "--max-tokens", "3", "To be"],
                         capture_output=True, text=True, timeout=300)
    assert len(json.loads(res.stdout.strip().splitlines()[-1])["token_ids"]) == 3  # a flag wins


def test_the_server_fills_what_requests_leave_unset(tiny_model_dir, tmp_path):  # noqa: F811
    model = _with_generation_config(tiny_model_dir, tmp_path / "m", {**GEN, "max_new_tokens": 40})
    srv = ServerProcess(model, tmp_path / "server.log")
    try:
        srv.wait_ready()

        def chat(**kw):
            body = {"messages": [{"role": "user", "content": "Speak"}], "ignore_eos": True, **kw}
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        a, b = chat(), chat()
        assert a["message"]["content"] == b["message"]["content"]  # temperature 0 from the model: greedy
        assert chat(max_tokens=3)["finish_reason"] == "length"
        # a min_tokens past the default max_tokens: the default gives way (the client set no max_tokens)
        wide = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Speak"}], "min_tokens": 50}).json()
        assert wide["usage"]["completion_tokens"] == 50, wide
        n40 = httpx.post(srv.url + "/tokenize", json={"messages": [{"role": "user", "content": "Speak"}]},
                         timeout=60).json()["count"]
        usage = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Speak"}], "ignore_eos": True}).json()["usage"]
        assert usage["completion_tokens"] == 40 and usage["prompt_tokens"] == n40
        sampled = {chat(temperature=1.5, seed=s)["message"]["content"] for s in range(4)}
        assert len(sampled) > 1  # a request's own temperature wins
        long = "to be or not " * 60  # leaves fewer than 40 tokens of the 256-token context: capped, not a 400
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": long, "max_tokens": None,
                                                                      "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 256
        assert body["usage"]["completion_tokens"] < 40
    finally:
        assert srv.terminate() == 0, srv.logs()
