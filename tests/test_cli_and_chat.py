"""`tokenmill generate` and `LLM.chat` end to end."""
import json
import subprocess
import sys

from tokenmill import SamplingParams
from conftest import hf_greedy, make_llm


def test_cli_generate_greedy_matches_transformers(model_dirs):
    path, hf = model_dirs["qwen2"]
    res = subprocess.run([sys.executable, "-m", "tokenmill", "generate", "--model", path, "--dtype", "float32",
                          "--temperature", "0", "--max-tokens", "8", "--ignore-eos", "--json", "To be"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    line = json.loads(res.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(path).encode("To be")
    assert line["token_ids"] == hf_greedy(hf, ids, 8)
    assert line["finish_reason"] == "length"


def test_cli_reports_bad_input_without_traceback(llama_dir):
    res = subprocess.run([sys.executable, "-m", "tokenmill", "generate", "--model", llama_dir, "--temperature",
                          "-1", "x"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "temperature" in res.stderr and "Traceback" not in res.stderr


def test_serve_rejects_a_bad_stream_interval_before_loading(llama_dir):
    res = subprocess.run([sys.executable, "-m", "tokenmill", "serve", "--model", llama_dir, "--stream-interval", "0"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--stream-interval" in res.stderr and "Traceback" not in res.stderr


def test_chat_applies_template(llama_dir):
    llm = make_llm(llama_dir)
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "To be"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n")
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids},
                          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
