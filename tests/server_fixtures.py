"""Fixtures for the server tests: a tiny random Llama with a byte-level BPE tokenizer and a chat template
(built once per session, no downloads), and a real `tokenmill serve` subprocess on a free loopback port."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import tokenmill
from tokenmill.entrypoints.server_process import free_port, stop, wait_until_up

CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + "
                 "message['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
                 "{% endif %}")

_TEXT = """To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles
And by opposing end them. To die, to sleep; No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks That flesh is heir to. 'Tis a consummation
Devoutly to be wish'd. All the world's a stage, and all the men and women merely players;
They have their exits and their entrances; And one man in his time plays many parts.
Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him.
Now is the winter of our discontent Made glorious summer by this sun of York.
你好，世界。今天天气很好。我们一起去公园散步吧。🚀🌟😀 Hello world! 123 456 789.
"""


def build_tiny_model(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


class ServerProcess:
    """`python -m tokenmill serve ...` as a subprocess; logs go to a file shown on failure."""

    def __init__(self, model: str, log_path: Path, *extra: str, api_key: str | None = None,
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_path
        args = [sys.executable, "-m", "tokenmill", "serve", "--model", model, "--port", str(self.port),
                "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "256",
                "--kv-cache-memory-gb", "0.05", "--served-model-name", "tiny", *extra]
        if api_key:
            args += ["--api-key", api_key]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})

    def wait_ready(self, timeout: float = 180) -> None:
        wait_until_up(self.proc, self.url + "/health", timeout, self.logs)

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def terminate(self, timeout: float = 60) -> int:
        code = stop(self.proc, timeout)
        self._log.close()
        return code


# A hook that makes each engine step running a prompt that starts with SLOW_MARKER take 0.1 s: requests that
# are surely still running when a test looks (other prompts keep their speed).
SLOW_MARKER = [9] * 11
SLOW_SITECUSTOMIZE = f'''
import time

from tokenmill.worker import model_runner

_marker = {SLOW_MARKER!r}
_execute = model_runner.ModelRunner.execute


def execute(self, sched):
    if any(list((s.new_request or self.requests[s.request_id]).prompt_token_ids[:len(_marker)]) == _marker
           for s in sched.seqs):
        time.sleep(0.1)
    return _execute(self, sched)


model_runner.ModelRunner.execute = execute
'''


def hook_env(hook_dir: Path, sitecustomize: str) -> dict:
    """Environment for a server whose processes (API and engine core) all run `sitecustomize` at startup:
    fault and spy hooks from outside the package."""
    (hook_dir / "sitecustomize.py").write_text(sitecustomize)
    # sitecustomize runs before `python -m` puts the working directory on the path: without this checkout first,
    # its imports would load an installed tokenmill (another clone's), or none, and the hook would silently fail
    checkout = str(Path(tokenmill.__file__).parents[1])
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(hook_dir), checkout, os.environ.get("PYTHONPATH")) if p)}


def core_pid(server) -> int:
    return int(open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()[0])


def engine_stats(server) -> dict:
    return httpx.get(server.url + "/debug/engine_stats", headers=server.headers, timeout=30).json()
