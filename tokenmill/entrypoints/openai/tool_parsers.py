"""Tool calls the model writes in its own format, for tool_choice "auto" (`--enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags). Each parser splits a choice's text into content and calls:

    hermes       ...content <tool_call>{"name": "f", "arguments": {...}}</tool_call> ... (Qwen 2.5 / 3, Hermes)
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]               (Llama 3.1 / 3.2)
    pythonic     [<|python_start|>][f(a=1, b="x"), g()][<|python_end|>]                    (Llama 3.2 / 4)
    mistral      ...content [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]           (Mistral, tokenizers
                 ...content [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}               before / from v11;
                                                                 special tokens: the text keeps them for it)

Content is the text outside the calls, as written; when there are calls, content that is only whitespace
(the newlines between them) is no content (null). Streaming: content streams as it comes, except text that may
be the start of a call, and whitespace before any other content, which are held back; a call goes out whole
(id, name, arguments) once its text is complete. A call that never completes (cut by max_tokens) goes out as
content when the choice finishes. Whole or streamed in any chunks, the content and calls are the same."""
from __future__ import annotations

import ast
import json
import uuid


def call_dict(name: str, arguments) -> dict:
    """A call as OpenAI's message carries it. ValueError for a name that is not text (a lone surrogate: the
    model wrote a half escape, "\\ud83d", which JSON decodes to a character UTF-8 cannot hold)."""
    name.encode("utf-8")  # (UnicodeEncodeError is a ValueError)
    args = arguments if isinstance(arguments, str) else _json_text(arguments)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _json_text(value) -> str:
    """JSON text that UTF-8 can carry: as written, but a lone surrogate (only ever inside a string) as its JSON
    escape, which backslashreplace writes. (allow_nan=False: a number past float range, 1e999, would come out as
    Infinity, which is not JSON: a ValueError.)"""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _call_from_json(text: str, args_key: str) -> dict | None:
    try:
        return _call_from_obj(json.loads(text, strict=False), args_key)  # (raw control characters are kept)
    except ValueError:  # not JSON
        return None


def _call_from_obj(obj, args_key: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    try:
        return call_dict(obj["name"], obj.get(args_key, obj.get("arguments", {})))
    except ValueError:  # arguments that cannot be JSON again (1e999), a name that is not text
        return None


class HermesParser:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def extract(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls): content is the text outside complete, well-formed call blocks."""
        content, calls, pos = [], [], 0
        while True:
            start = text.find(self.OPEN, pos)
            end = text.find(self.CLOSE, start + len(self.OPEN)) if start >= 0 else -1
            if end < 0:
                content.append(text[pos:])
                break
            call = _call_from_json(text[start + len(self.OPEN):end].strip(), "arguments")
            content.append(text[pos:start] if call is not None else text[pos:end + len(self.CLOSE)])
            if call is not None:
                calls.append(call)
            pos = end + len(self.CLOSE)
        return "".join(content), calls

    def stream(self, buffer: str, finished: bool) -> tuple[str, list[dict], str]:
        """(content to send, calls to send, text to keep) from the unsent `buffer`."""
        start = buffer.find(self.OPEN)
        if start < 0:
            if finished:
                return buffer, [], ""
            keep = _partial_suffix(buffer, self.OPEN)  # the start of an opening tag: hold it back
            return buffer[:len(buffer) - keep], [], buffer[len(buffer) - keep:]
        end = buffer.find(self.CLOSE, start)
        if end < 0:
            return (buffer, [], "") if finished else (buffer[:start], [], buffer[start:])
        content, calls = self.extract(buffer[:end + len(self.CLOSE)])
        more_content, more_calls, rest = self.stream(buffer[end + len(self.CLOSE):], finished)
        return (content if not calls else buffer[:start]) + more_content, calls + more_calls, rest


class _LeadingCallsParser:
    """A format whose calls, when there are any, are the whole output: text that could begin them (`starts`)
    is held back until the output ends, then read whole; other text streams as content at once."""
    starts: tuple[str, ...] = ()

    def __init__(self):
        self.texting = False  # content has gone out: the rest is content too (calls must come first)

    def stream(self, buffer: str, finished: bool) -> tuple[str, list[dict], str]:
        lead = buffer.lstrip()
        maybe_call = lead.startswith(self.starts) or any(s.startswith(lead) for s in self.starts if lead)
        if self.texting or (not maybe_call and lead):
            self.texting = True
            return buffer, [], ""
        if not finished:
            return "", [], buffer
        content, calls = self.extract(buffer)
        return content, calls, ""


class Llama3JsonParser(_LeadingCallsParser):
    TAG = "<|python_tag|>"
    starts = ("{", TAG)

    def extract(self, text: str) -> tuple[str, list[dict]]:
        body = text.strip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            return text, []
        calls, pos, decoder = [], 0, json.JSONDecoder(strict=False)
        while pos < len(body):  # objects one after another, joined by ";" (never split inside a string)
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call_from_obj(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return "", calls



class PythonicParser(_LeadingCallsParser):
    """A Python list of calls with keyword arguments of literals (vLLM's "pythonic"). Read with `ast` (parsed,
    never run): anything but calls of plain names with literal keyword values is text."""
    START, END = "<|python_start|>", "<|python_end|>"
    starts = ("[", START)

    def extract(self, text: str) -> tuple[str, list[dict]]:
        body = text.strip()
        body = body[len(self.START):] if body.startswith(self.START) else body
        body = body[:-len(self.END)] if body.endswith(self.END) else body
        calls = _python_calls(body.strip())
        return ("", calls) if calls else (text, [])


def _python_calls(body: str) -> list[dict]:
    if not body.startswith("["):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(args) != len(node.keywords):  # **kwargs
                return []
            calls.append(call_dict(node.func.id, args))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # (TypeError: a set, bytes)
            return []
    return calls


class MistralParser:
    """[TOOL_CALLS] then a JSON list of {"name", "arguments"} (or one object), or name[ARGS]{json} per call
    (each after its own [TOOL_CALLS]). [TOOL_CALLS] is a special token, left out of the text by
    skip_special_tokens: an output that is a bare JSON call list reads the same. Content may come first."""
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens: the output's text must keep them

    def __init__(self):
        self.texting = False  # content has gone out: a bare call list can no longer come

    def extract(self, text: str) -> tuple[str, list[dict]]:
        start = text.find(self.TAG)
        if start < 0:
            body = text.strip()
            calls = _json_calls(body) if body.startswith("[") else []
            return ("", calls) if calls else (text, [])
        body = text[start + len(self.TAG):].strip()
        calls = _json_calls(body) if body.startswith(("[", "{")) else self._args_calls(body)
        return (text[:start], calls) if calls else (text, [])

    def _args_calls(self, body: str) -> list[dict]:
        calls = []
        for part in body.split(self.TAG):
            name, sep, args = part.partition(self.ARGS)
            if not sep or not name.strip():
                return []
            try:
                calls.append(call_dict(name.strip(), json.loads(args, strict=False)))
            except ValueError:  # not JSON, 1e999, a name that is not text
                return []
        return calls

    def stream(self, buffer: str, finished: bool) -> tuple[str, list[dict], str]:
        start = buffer.find(self.TAG)
        if start >= 0:  # content before the calls goes out; the calls are read once the output ends
            self.texting = True
            if not finished:
                return buffer[:start], [], buffer[start:]
            content, calls = self.extract(buffer)
            return (buffer[:start], calls, "") if calls else (buffer, [], "")
        lead = buffer.lstrip()
        if not self.texting and (lead.startswith("[") or not lead):  # a bare call list, or the tag's first half
            if not finished:
                return "", [], buffer
            content, calls = self.extract(buffer)
            return content, calls, ""
        self.texting = True
        if finished:
            return buffer, [], ""
        keep = _partial_suffix(buffer, self.TAG)
        return buffer[:len(buffer) - keep], [], buffer[len(buffer) - keep:]


def _json_calls(body: str) -> list[dict]:
    """A JSON list of call objects, or one call object, with nothing after it; [] where it is not one."""
    try:
        obj, end = json.JSONDecoder(strict=False).raw_decode(body)
    except ValueError:
        return []
    if body[end:].strip():
        return []
    calls = [_call_from_obj(o, "arguments") for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(c is not None for c in calls) else []


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser,
                "mistral": MistralParser}


class AutoToolCalls:
    """tool_choice "auto": the parser's calls out of each choice's text, whole or streamed."""

    grammar = None  # the model writes freely

    def __init__(self, parser_name: str, parallel: bool = True):
        self.make_parser = TOOL_PARSERS[parser_name]
        self.max_calls = None if parallel else 1  # parallel_tool_calls false: calls past the first are dropped
        # (as vLLM: the request's text then keeps the special tokens the parser reads)
        self.keeps_special_tokens = getattr(self.make_parser, "keeps_special_tokens", False)
        self.parser = self.make_parser()
        self.streams: dict[int, object] = {}  # per choice: its parser while streaming (they keep state)
        self.pending: dict[int, str] = {}  # per choice: streamed text not sent yet
        self.num_calls: dict[int, int] = {}
        self.held: dict[int, str] = {}  # per choice: whitespace streamed before any other content, not sent yet
        self.texted: set[int] = set()  # choices that sent content other than whitespace

    def message(self, index: int, text: str) -> dict:
        content, calls = self.parser.extract(text)
        calls = calls[:self.max_calls]
        message = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, index: int, message_or_delta: dict, finish: str | None) -> str | None:
        return "tool_calls" if finish == "stop" and (message_or_delta.get("tool_calls") or self.num_calls.get(index)) \
            else finish

    def stream_delta(self, index: int, text: str, finished: bool) -> dict:
        parser = self.streams.get(index) or self.streams.setdefault(index, self.make_parser())
        content, calls, self.pending[index] = parser.stream(self.pending.get(index, "") + text, finished)
        if index not in self.texted:  # whitespace waits for text (sent with it) or the end (sent if no calls)
            content = self.held.pop(index, "") + content
            if content.strip():
                self.texted.add(index)
            elif not finished or calls or self.num_calls.get(index):
                if not finished:
                    self.held[index] = content
                content = ""
        delta = {}
        if content:
            delta["content"] = content
        if calls and self.max_calls is not None:
            calls = calls[:max(0, self.max_calls - self.num_calls.get(index, 0))]
        if calls:
            first = self.num_calls.get(index, 0)
            self.num_calls[index] = first + len(calls)
            delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
        return delta
