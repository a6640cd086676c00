"""End to end: start a server on a tiny model, run `bench serve` for a few requests, check the JSON result is
complete and consistent with what the server reported. Servers: the transformers static-batching reference
(tokenmill.bench.hf_server) and `tokenmill serve`."""
import asyncio
import json
import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tokenmill.bench.datasets import RandomDataset, get_tokenizer, sample_requests
from tokenmill.bench.report import render_report
from tokenmill.bench.serve_client import run_benchmark
from tokenmill.config import DEFAULT_MODEL
from tokenmill.entrypoints.server_process import wait_until_up


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """2 layers, hidden 64, random weights, the shipped model's tokenizer (vocab 4096)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-bench-llama")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL) / f, path / f)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, args: list[str], log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", *args, "--host", "127.0.0.1", "--port", str(self.port)],
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            wait_until_up(self.proc, self.url + "/v1/models", 90, lambda: log.read_text()[-3000:])
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def hf_server(tiny_model, tmp_path_factory):
    s = _Server(["tokenmill.bench.hf_server", "--model", tiny_model, "--served-model-name", "tiny",
                 "--max-batch-size", "4", "--batch-timeout-ms", "20"], tmp_path_factory.mktemp("logs") / "hf.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenmill_server(tiny_model, tmp_path_factory):
    s = _Server(["tokenmill", "serve", "--model", tiny_model, "--served-model-name", "tiny", "--dtype", "float32",
                 "--max-model-len", "256", "--kv-cache-memory-gb", "0.02"],
                tmp_path_factory.mktemp("logs") / "tokenmill.log")
    yield s
    s.stop()


def check_result(res: dict, reqs, one_chunk_per_token: bool) -> None:
    """Complete and consistent: every field present, totals = sums, token counts = the server's usage."""
    n = len(reqs)
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
                "max_output_tokens_per_s", *(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p50", "p90", "p99")
                                             for m in ("ttft", "tpot", "itl", "e2el"))):
        assert key in res and res[key] is not None and math.isfinite(res[key]), key
    for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors", "successes"):
        assert len(res[key]) == n, key
    assert res["completed"] == n and res["failed"] == 0, res["errors"]
    assert res["output_lens_source"] == ["usage"] * n  # counted by the server, not guessed
    assert res["total_output_tokens"] == sum(res["output_lens"])
    assert res["total_input_tokens"] == sum(res["input_lens"])
    for i, r in enumerate(reqs):
        assert 1 <= res["output_lens"][i] <= r.expected_output_len
        assert 0 < res["ttfts"][i] <= res["latencies"][i]
        assert res["ttfts"][i] + sum(res["itls"][i]) == pytest.approx(res["latencies"][i])
        if one_chunk_per_token:
            assert len(res["itls"][i]) == res["output_lens"][i] - 1
        else:
            assert len(res["itls"][i]) <= res["output_lens"][i] - 1
    assert 1 <= res["max_concurrent_requests"] <= n
    json.dumps(res)


def _bench(server, reqs, **kw):
    return asyncio.run(run_benchmark(reqs, server.url, "tiny", disable_tqdm=True, **kw))


def test_hf_reference_server(hf_server, tiny_model, tmp_path):
    tok = get_tokenizer(tiny_model)
    reqs = sample_requests(RandomDataset(24, 6, 0.5), 10, tok, seed=0)
    res = _bench(hf_server, reqs, tokenizer=tok, ignore_eos=True, goodput_slos_ms={"ttft": 1e7})
    check_result(res, reqs, one_chunk_per_token=True)
    # exact prompts as token ids: the server's prompt_tokens equal the dataset's lengths
    assert res["input_lens"] == [r.prompt_len for r in reqs]
    assert res["output_lens"] == [r.expected_output_len for r in reqs]
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    # honest static batching: never more than --max-batch-size in a batch, everything ran
    b = httpx.get(hf_server.url + "/debug/batches").json()
    assert max(b["batch_sizes"]) <= 4 and sum(b["batch_sizes"]) >= 10

    # EOS allowed, Poisson arrivals, a concurrency cap: counts still come from usage
    res2 = _bench(hf_server, reqs[:6], tokenizer=tok, request_rate=50.0, max_concurrency=2, seed=1,
                  sampling={"temperature": 0.0})
    check_result(res2, reqs[:6], one_chunk_per_token=True)
    assert res2["max_concurrent_requests"] <= 2 and res2["request_rate"] == 50.0

    # non-streaming request: same usage shape
    body = httpx.post(hf_server.url + "/v1/completions",
                      json={"model": "tiny", "prompt": reqs[0].prompt, "max_tokens": 3, "ignore_eos": True}).json()
    assert body["usage"] == {"prompt_tokens": reqs[0].prompt_len, "completion_tokens": 3,
                             "total_tokens": reqs[0].prompt_len + 3}

    # and the report renders from real results
    for name, r in (("a.json", res), ("b.json", res2)):
        (tmp_path / name).write_text(json.dumps(r))
    md = render_report([str(tmp_path / "a.json"), str(tmp_path / "b.json")], str(tmp_path / "rep"))
    assert "latency_cdf.png" in Path(md).read_text() and (tmp_path / "rep" / "latency_cdf.png").stat().st_size


def test_cli_against_hf_server(hf_server, tiny_model, tmp_path):
    out = tmp_path / "serve.json"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "serve", "--base-url", hf_server.url, "--served-model-name",
           "tiny", "--tokenizer", tiny_model, "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
           "--ignore-eos", "--disable-tqdm", "--goodput", "ttft:100000", "--metric-percentiles", "50,99.9",
           "--result-file", str(out), "--label", "hf", "--metadata", "note=ci"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Serving Benchmark Result" in proc.stdout and "P99.9 TTFT (ms):" in proc.stdout
    res = json.loads(out.read_text())
    assert res["label"] == "hf" and res["metadata"] == {"note": "ci"} and res["completed"] == 4
    assert res["total_output_tokens"] == 16 and res["total_input_tokens"] == 64
    assert "p99.9_ttft_ms" in res and res["request_goodput"] is not None


def test_tokenmill_server(tokenmill_server, tiny_model):
    tok = get_tokenizer(tiny_model)
    reqs = sample_requests(RandomDataset(24, 6, 0.5), 8, tok, seed=0)
    res = _bench(tokenmill_server, reqs, tokenizer=tok, ignore_eos=True)
    check_result(res, reqs, one_chunk_per_token=False)
    assert res["input_lens"] == [r.prompt_len for r in reqs]
    assert res["output_lens"] == [r.expected_output_len for r in reqs]
    # chat endpoint: the role-only opener must not count as the first token
    chat = _bench(tokenmill_server, reqs[:3], tokenizer=tok, endpoint="chat", ignore_eos=True)
    check_result(chat, reqs[:3], one_chunk_per_token=False)
    assert chat["backend"] == "openai-chat" and chat["output_lens"] == [r.expected_output_len for r in reqs[:3]]
    assert all(n > r.prompt_len for n, r in zip(chat["input_lens"], reqs[:3]))  # the chat template adds tokens
