"""Server-only flags of `tokenmill serve` (vLLM's names). Kept free of heavy imports: the CLI builds its
parser before it knows which command runs."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; a response carries the name its request used, /v1/models "
                        "lists them all (default: the --model argument; the shipped model's short name)")
    p.add_argument("--api-key", nargs="+", default=None,
                   help="require 'Authorization: Bearer KEY' (any of the keys given) on every endpoint but "
                        "/health, /metrics, /version and the API docs (or set TOKENMILL_API_KEY, or vLLM's "
                        "VLLM_API_KEY)")
    p.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                   help="sequences admitted but not yet producing tokens; beyond it requests get 429")
    p.add_argument("--max-request-body-bytes", type=positive_int, default=8 << 20, help="larger bodies get 413")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish; past it they end with a 503 error")
    p.add_argument("--keep-alive-on-engine-death", action="store_true",
                   help="when the engine core dies, keep answering 503 until stopped instead of exiting with "
                        "code 1 (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)")
    p.add_argument("--stream-interval", type=positive_int, default=1,
                   help="tokens per streamed chunk (the first tokens go out at once, the last chunk may have fewer); more tokens per chunk cost the API "
                        "process less CPU per token at the price of burstier streams")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) used in place of the tokenizer's, "
                        "for /v1/chat/completions and /tokenize")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (the `chat_template` field; refused with a "
                        "400 otherwise, as in vLLM): a template is code the server runs")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries an X-Request-Id header: the request's own, or a new id (vLLM's flag)")
    p.add_argument("--response-role", default="assistant",
                   help="the role of chat answers where the request asks for a generation prompt (the default); "
                        "without one an answer has the last message's role (as in vLLM)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (OpenAI's default with tools): the model's own tool-call text is "
                        "read by --tool-call-parser into tool_calls")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "pythonic", "mistral"],
                   help="the model family's tool-call format: hermes (Qwen 2.5 / 3, Hermes: <tool_call>{...}"
                        "</tool_call>), llama3_json (Llama 3.1 / 3.2: a JSON object with name and parameters), "
                        "pythonic (Llama 3.2 / 4: [f(a=1), g()]) or mistral ([TOOL_CALLS] and JSON calls)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="split a thinking model's <think>...</think> from its answer into the chat message's "
                        "reasoning_content: deepseek_r1 (the output opens in reasoning) or qwen3 (reasoning only "
                        "where the output opens with <think>)")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
