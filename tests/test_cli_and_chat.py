"""`tokenmill generate` and `LLM.chat` end to end."""
import json
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("argv, message", [
    (["generate", "--num-threads", "100000", "x"], "num_threads 100000 is far past"),  # torch segfaulted
    (["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 1000000000}', "x"],
     "num_speculative_tokens must be an integer >= 1 and <= 64"),  # hung building per-depth tables
    (["generate", "--kv-cache-memory-gb", "inf", "x"], "must be a finite number"),
    (["generate", "--limit-mm-per-prompt", "{bad", "x"], "limit_mm_per_prompt is not a JSON object"),
    (["generate", "--num-kv-blocks", "0", "x"], "num_kv_blocks must be a positive integer"),
    (["generate", "--mm-video-num-frames", "0", "x"], "mm_video_num_frames must be a positive integer"),
    (["generate", "--mm-max-image-pixels", "-5", "x"], "mm_max_image_pixels must be a positive integer"),
    (["generate", "--distributed-timeout-s", "-1", "x"], "distributed_timeout_s must be a finite number"),
    (["generate", "--kv-host-cache-gb", "inf", "x"], "must be finite numbers"),  # a traceback after the load
    (["serve", "--port", "70000"], "must be a TCP port"),  # it listened on 70000 - 65536
    (["serve", "--max-waiting-requests", "0"], "must be >= 1"),  # every request got a 400
    (["serve", "--max-request-body-bytes", "-1"], "must be >= 1"),
    (["serve", "--host", "999.1.1.1"], "does not resolve"),  # after minutes of loading
    (["serve", "TAKEN"], "cannot listen on"),
    (["serve", "NO_WEIGHTS"], "the engine did not start: ValueError: no model.safetensors"),  # three tracebacks
    (["bench", "comm", "--sizes", "0B..64MiB"], "--sizes"),  # looped for ever
    (["bench", "comm", "--iters", "0"], "must be >= 1"),
    (["bench", "serve", "--num-prompts", "0"], "must be >= 1"),
    (["bench", "serve", "--output-len", "0"], "must be >= 1"),  # silently 128
    (["eval", "ppl", "--window", "0"], "must be >= 1"),  # silently max_model_len
    (["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "no"}',
      "x"], "adaptive must be true or false"),  # read as true
])
def test_cli_refuses_bad_settings_with_one_line(llama_dir, tmp_path, capsys, argv, message):
    """Settings that crashed, hung or failed late (after loading, or after a whole benchmark) get one line
    and exit code 2 before anything runs."""
    import shutil
    import socket

    from tokenmill.entrypoints.cli import main
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    if argv[-1] == "TAKEN":
        argv = ["serve", "--model", llama_dir, "--port", str(taken.getsockname()[1])]
    elif argv[-1] == "NO_WEIGHTS":
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{llama_dir}/{name}", tmp_path / name)
        argv = ["serve", "--model", str(tmp_path), "--port", "0"]
    elif argv[0] in ("generate", "serve"):
        argv = [argv[0], "--model", llama_dir, *argv[1:]]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


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


def test_chat_continues_the_final_message(llama_dir):
    """continue_final_message (vLLM's): the prompt ends inside the last message, with no end of turn, and the
    model continues it; it cannot be combined with add_generation_prompt (a new turn)."""
    llm = make_llm(llama_dir)
    msgs = [{"role": "user", "content": "To be"}, {"role": "assistant", "content": "or not"}]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.chat(msgs, sp, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt == "<|user|>\nTo be\n<|assistant|>\nor not"
    closed = llm.chat(msgs, sp, use_tqdm=False, add_generation_prompt=False)[0]
    assert closed.prompt == out.prompt + "\n"  # the turn's end
    direct = llm.generate({"prompt_token_ids": out.prompt_token_ids}, sp, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(msgs, sp, use_tqdm=False, continue_final_message=True)


def test_chat_passes_tools_and_template_kwargs_to_the_template(llama_dir, tmp_path):
    """vLLM's LLM.chat(tools=..., chat_template_kwargs=...): both reach the template; `tokenmill serve
    --chat-template` takes a file or the template itself and refuses one that does not compile."""
    from tokenmill.entrypoints.openai.api_server import load_chat_template
    llm = make_llm(llama_dir)
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% if think %}/think\n{% endif %}")
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    sp = SamplingParams(temperature=0, max_tokens=1)
    out = llm.chat([{"role": "user", "content": "To be"}], sp, use_tqdm=False, chat_template=template, tools=tools,
                   chat_template_kwargs={"think": True})[0]
    assert out.prompt == "user: To be\ntools: lookup\n/think\n"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template == load_chat_template(template)
    with pytest.raises(ValueError, match="does not compile"):
        load_chat_template("{% for m in messages %}")
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
