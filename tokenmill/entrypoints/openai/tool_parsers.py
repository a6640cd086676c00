"""Tool calls the model writes in its own format, for tool_choice "auto" (`--enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags). Each parser splits a choice's text into content and calls:

    hermes       ...content <tool_call>{"name": "f", "arguments": {...}}</tool_call> ... (Qwen 2.5 / 3, Hermes)
    llama3_json  [<|python_tag|>]{"name": "f", "parameters": {...}}[; {...}]               (Llama 3.1 / 3.2)
    pythonic     [<|python_start|>][f(a=1, b="x"), g()][<|python_end|>]                    (Llama 3.2 / 4)
    mistral      ...content [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]           (Mistral, tokenizers
                 ...content [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}               before / from v11;
                                                                 special tokens: the text keeps them for it)

A parser reads the text as it comes (`feed`, the same whole or in any chunks) and says what it holds as events,
in order: ("text", None, content), ("name", i, name) when call i begins, ("args", i, text) for more of its
arguments, ("done", i, None) once they are complete. The whole text's message is the same events, gathered.

The JSON formats' arguments are their text as the model wrote it (a raw control character in a string as its
escape, as strict JSON needs), so what has been read of them is always the start of what they will be, and
they stream as they are written. A call begins once its name is read and its arguments have begun (or its
object ended without any: "{}"); from then on it is a call, even if the text after is cut off or malformed
(its arguments are then what the model wrote; OpenAI's may be invalid JSON too). Text that could still begin
a call is held back; text that turns out to be none (not JSON, no name, cut off before the arguments) is
content. Pythonic calls are Python, made JSON: they go out whole, once the list is complete.

Content is the text outside the calls, as written; when there are calls, content that is only whitespace
(the newlines between them) is no content (null)."""
from __future__ import annotations

import ast
import json
import uuid

from tokenmill.entrypoints.openai.tool_call_reader import WHITESPACE, CallReader


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


class _Parser:
    """Reads one choice's text as it comes; subclasses' _run turns `buf` into events."""

    def __init__(self):
        self.buf = ""  # text not read yet
        self.events: list[tuple] = []
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> list[tuple]:
        self.buf += text
        self._run(finished)
        events, self.events = self.events, []
        return events

    def extract(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls) of a whole text (read by a parser of its own)."""
        content, calls, _ = _collect(type(self)().feed(text, True))
        return content, calls

    def _run(self, finished: bool) -> None:
        raise NotImplementedError

    def _text(self, text: str) -> None:
        if text:
            self.events.append(("text", None, text))

    def _sync(self, reader: CallReader) -> None:
        """The events for what `reader` has read of its call since the last time."""
        if not reader.call:
            return
        if reader.index is None:
            reader.index = self.num_calls
            self.num_calls += 1
            self.events.append(("name", reader.index, reader.name))
        if reader.args:
            self.events.append(("args", reader.index, "".join(reader.args)))
            reader.args.clear()
        if reader.args_done and not reader.done_sent:
            reader.done_sent = True
            self.events.append(("done", reader.index, None))


def _collect(events: list[tuple], max_calls: int | None = None) -> tuple[str, list[dict], list[bool]]:
    """(content, calls, whether each call's arguments are complete) from a parser's events."""
    content, calls, done = [], [], []
    for kind, i, value in events:
        if kind == "text":
            content.append(value)
        elif max_calls is not None and i >= max_calls:
            continue
        elif kind == "name":
            calls.append(call_dict(value, ""))
            done.append(False)
        elif kind == "args":
            calls[i]["function"]["arguments"] += value
        else:
            done[i] = True
    return "".join(content), calls, done


class HermesParser(_Parser):
    """Blocks of a call object each (or several, one after another), anywhere in the text. A block ends at its
    closing tag (or the text's end); after its calls, what is not another one is not read. A block that holds no
    call is content, tags and all."""
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.block = None  # the open block's text, from its tag (content if it holds no call); None outside
        self.reader = None
        self.first = 0  # the number of the block's first call

    def _run(self, finished: bool) -> None:
        while True:
            buf = self.buf
            if self.block is None:
                start = buf.find(self.OPEN)
                if start < 0:  # (the start of an opening tag is held back)
                    cut = len(buf) - (0 if finished else _partial_suffix(buf, self.OPEN))
                    self._text(buf[:cut])
                    self.buf = buf[cut:]
                    return
                self._text(buf[:start])
                self.buf = buf[start + len(self.OPEN):]
                self.block, self.reader, self.first = [self.OPEN], CallReader(), self.num_calls
                continue
            end = buf.find(self.CLOSE)
            cut = end if end >= 0 else len(buf) - (0 if finished else _partial_suffix(buf, self.CLOSE))
            self._read(buf[:cut])
            self.buf = buf[cut:]
            if end < 0 and not finished:
                return
            if end >= 0:
                self.block.append(self.CLOSE)
                self.buf = self.buf[len(self.CLOSE):]
            if self.num_calls == self.first:  # no call in it: content
                self._text("".join(self.block))
            self.block = self.reader = None
            if end < 0:
                return

    def _read(self, body: str) -> None:
        if self.num_calls == self.first:
            self.block.append(body)
        pos = 0
        while True:
            pos += self.reader.feed(body[pos:])
            self._sync(self.reader)
            if not (self.reader.closed and self.reader.call):
                return
            self.block.clear()
            self.reader = CallReader()  # another call object may follow in the block
            if pos == len(body):
                return


class Llama3JsonParser(_Parser):
    """Call objects, joined by ";", that are the whole output when there are any: text that could begin them is
    held back. When the first object is no call the whole text is content; text after the calls that is none
    is content too (from there on)."""
    TAG = "<|python_tag|>"

    def __init__(self):
        super().__init__()
        self.mode = "lead"  # "lead": only whitespace so far; "calls"; "text": the rest is content
        self.raw: list[str] = []  # text read as calls that no call has taken: content if what follows is none
        self.reader = None

    def _run(self, finished: bool) -> None:
        if self.mode == "lead":
            lead = self.buf.lstrip()
            if lead.startswith((self.TAG, "{")):
                self.mode = "calls"
                if lead.startswith(self.TAG):
                    n = len(self.buf) - len(lead) + len(self.TAG)
                    self.raw.append(self.buf[:n])
                    self.buf = self.buf[n:]
            elif not finished and (not lead or self.TAG.startswith(lead)):
                return
            else:
                self.mode = "text"
        if self.mode == "calls":
            self._calls(finished)
        if self.mode == "text":
            self._text(self.buf)
            self.buf = ""

    def _calls(self, finished: bool) -> None:
        while True:
            if self.reader is None:
                rest = self.buf.lstrip(WHITESPACE + ";")
                self.raw.append(self.buf[:len(self.buf) - len(rest)])
                self.buf = rest
                if not rest:
                    if finished and not self.num_calls:
                        self._not_calls()
                    return
                if rest[0] != "{":
                    return self._not_calls()
                self.reader = CallReader(("parameters", "arguments"))
            n = self.reader.feed(self.buf)
            self.raw.append(self.buf[:n])
            self.buf = self.buf[n:]
            self._sync(self.reader)
            if self.reader.call:
                self.raw.clear()
            if self.reader.bad:
                return self._not_calls()
            if self.reader.closed:
                self.reader = None
                continue
            if finished and not self.reader.call:  # cut off before it was a call
                self._not_calls()
            return

    def _not_calls(self) -> None:
        self._text("".join(self.raw))
        self.raw, self.reader, self.mode = [], None, "text"


class PythonicParser(_Parser):
    """A Python list of calls with keyword arguments of literals (vLLM's "pythonic"). Read with `ast` (parsed,
    never run): anything but calls of plain names with literal keyword values is text. Text that could begin
    the list is held back until the output ends, then read whole: the calls go out whole (their JSON is made
    from Python's values, so it cannot stream as written); other text streams as content at once."""
    START, END = "<|python_start|>", "<|python_end|>"
    starts = ("[", START)

    def __init__(self):
        super().__init__()
        self.texting = False  # content has gone out: the rest is content too (calls must come first)

    def _run(self, finished: bool) -> None:
        lead = self.buf.lstrip()
        maybe_call = lead.startswith(self.starts) or any(s.startswith(lead) for s in self.starts if lead)
        if self.texting or (not maybe_call and lead):
            self.texting = True
        elif not finished:
            return
        else:
            body = lead.rstrip()
            body = body[len(self.START):] if body.startswith(self.START) else body
            body = body[:-len(self.END)] if body.endswith(self.END) else body
            calls = _python_calls(body.strip())
            for i, (name, args) in enumerate(calls):
                self.events += [("name", i, name), ("args", i, args), ("done", i, None)]
            self.num_calls = len(calls)
            if calls:
                self.buf = ""
        self._text(self.buf)
        self.buf = ""


def _python_calls(body: str) -> list[tuple[str, str]]:
    """[(name, arguments JSON)] of a list of calls; [] where it is not one."""
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
            calls.append((node.func.id, _json_text(args)))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # (TypeError: a set, bytes)
            return []
    return calls


class MistralParser(_Parser):
    """[TOOL_CALLS] then a JSON list of {"name", "arguments"} (or one object), or name[ARGS]{json} per call
    (each after its own [TOOL_CALLS]). [TOOL_CALLS] is a special token, left out of the text by
    skip_special_tokens: an output that starts with a bare JSON call list reads the same. Content may come
    first. A [TOOL_CALLS] ends what came before it. A section (from a tag) that holds no call is content, and
    so is text after the calls that begins none."""
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens: the output's text must keep them

    def __init__(self):
        super().__init__()
        self.mode = "start"  # "start" (only whitespace so far), "text", "section" (calls), "after" (a section's)
        self.raw: list[str] = []  # the section's text no call has taken: content if it holds none
        self.sub = None  # in a section: "head", "item", "object", "next", "name", "args"
        self.in_list = self.bare = False  # bare: a list without its tag
        self.reader = None
        self.name = ""  # name[ARGS]: the text since the tag
        self.first = 0  # the number of the section's first call

    def _open(self, bare: bool) -> None:
        self.mode, self.sub, self.raw, self.first, self.bare = "section", "head", [], self.num_calls, bare
        if not bare:
            self.raw.append(self.TAG)
            self.buf = self.buf[len(self.TAG):]

    def _run(self, finished: bool) -> None:
        while True:
            buf = self.buf
            if self.mode in ("start", "after"):
                lead = buf.lstrip()
                if lead.startswith(self.TAG):
                    if self.mode == "start":
                        self._text(buf[:len(buf) - len(lead)])
                    self.buf = lead
                    self._open(bare=False)
                elif not finished and (not lead or self.TAG.startswith(lead)):
                    return
                elif self.mode == "start" and lead.startswith("["):  # a bare call list (the tag skipped)
                    self._open(bare=True)
                elif self.mode == "after" and not lead:  # (finished: whitespace after the calls)
                    self.buf = ""
                    return
                else:
                    self.mode = "text"
                continue
            if self.mode == "text":
                start = buf.find(self.TAG)
                if start < 0:
                    cut = len(buf) - (0 if finished else _partial_suffix(buf, self.TAG))
                    self._text(buf[:cut])
                    self.buf = buf[cut:]
                    return
                self._text(buf[:start])
                self.buf = buf[start:]
                self._open(bare=False)
                continue
            end = buf.find(self.TAG)
            cut = end if end >= 0 else len(buf) - (0 if finished else _partial_suffix(buf, self.TAG))
            self._section(cut)
            if self.mode != "section":
                continue
            if end < 0 and not finished:
                return
            # the section ends here: at the next tag, or the output's end
            whole = self.sub in ("object", "args") and self.reader.call
            if whole or (self.sub in ("item", "next") and self.num_calls > self.first):
                self.raw, self.mode = [], "after"
            else:
                self._fail()
            if end < 0:
                return

    def _section(self, cut: int) -> None:
        """Reads the section's text in buf[:cut] (none of it a tag)."""
        buf, i = self.buf, 0
        while i < cut and self.mode == "section":
            sub = self.sub
            if sub in ("object", "args"):
                n = self.reader.feed(buf[i:cut])
                self.raw.append(buf[i:i + n])
                i += n
                self._sync(self.reader)
                if self.reader.call:
                    self.raw.clear()
                if self.reader.bad:
                    self._fail()
                elif self.reader.closed:
                    self.reader = None
                    if sub == "object" and self.in_list:
                        self.sub = "next"
                    else:
                        self.raw, self.mode = [], "after"
                continue
            if sub == "name":
                seen = len(self.name)
                self.name += buf[i:cut]
                k = self.name.find(self.ARGS)
                if k < 0:
                    self.raw.append(buf[i:cut])
                    i = cut
                    continue
                step = k + len(self.ARGS) - seen
                self.raw.append(buf[i:i + step])
                i += step
                name = self.name[:k].strip()
                if not name:
                    self._fail()
                else:
                    self.sub, self.reader = "args", CallReader(name=name)
                continue
            c = buf[i]
            if c in WHITESPACE:
                self.raw.append(c)
                i += 1
                continue
            if sub == "head" and c == "[":
                self.sub, self.in_list = "item", True
            elif (sub == "head" or sub == "item") and c == "{":
                self.sub, self.reader = "object", CallReader()
                self.in_list = sub == "item"
                continue  # (the reader reads the brace)
            elif sub == "head" and not self.bare:
                self.sub, self.name = "name", ""
                continue
            elif sub == "next" and c == ",":
                self.sub = "item"
            elif (sub == "next" or sub == "item") and c == "]" and self.num_calls > self.first:
                self.raw, self.mode = [], "after"
            else:
                self._fail()
                continue
            self.raw.append(c)
            i += 1
        self.buf = buf[i:]

    def _fail(self) -> None:
        """The section holds no (more) calls: its text is content, and what follows is read as text."""
        self._text("".join(self.raw))
        self.raw, self.reader, self.mode = [], None, "text"


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser,
                "mistral": MistralParser}


class AutoToolCalls:
    """tool_choice "auto": the parser's calls out of each choice's text, whole or streamed. Streamed, a call's
    first delta carries its index, id, type and name; its arguments follow in pieces as they are written, which
    join to the whole text's arguments exactly."""

    grammar = None  # the model writes freely

    def __init__(self, parser_name: str, parallel: bool = True):
        self.make_parser = TOOL_PARSERS[parser_name]
        self.max_calls = None if parallel else 1  # parallel_tool_calls false: calls past the first are dropped
        # (as vLLM: the request's text then keeps the special tokens the parser reads)
        self.keeps_special_tokens = getattr(self.make_parser, "keeps_special_tokens", False)
        self.streams: dict[int, _Parser] = {}  # per choice: its parser while streaming (they keep state)
        self.num_calls: dict[int, int] = {}  # per choice: the calls sent so far
        self.open_calls: dict[int, set[int]] = {}  # per choice: calls sent whose arguments are not complete yet
        self.complete: dict[int, bool] = {}  # per finished choice: it made calls, each of them complete
        self.held: dict[int, str] = {}  # per choice: whitespace streamed before any other content, not sent yet
        self.texted: set[int] = set()  # choices that sent content other than whitespace

    def message(self, index: int, text: str) -> dict:
        content, calls, done = _collect(self.make_parser().feed(text, True), self.max_calls)
        self.complete[index] = bool(calls) and all(done)
        message = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, index: int, message_or_delta: dict, finish: str | None) -> str | None:
        """"tool_calls" for a choice that made calls, each complete, whether the output then stopped or ran into
        max_tokens (the calls are whole: a client runs them); a call cut off keeps the output's own reason
        ("length"), whole and streamed."""
        return "tool_calls" if finish in ("stop", "length") and self.complete.get(index) else finish

    def stream_delta(self, index: int, text: str, finished: bool) -> dict:
        parser = self.streams.get(index) or self.streams.setdefault(index, self.make_parser())
        events = parser.feed(text, finished)
        content = "".join(value for kind, _, value in events if kind == "text")
        open_calls = self.open_calls.setdefault(index, set())
        calls: dict[int, dict] = {}  # this delta's, by index: a call's start, and the pieces of arguments
        for kind, i, value in events:
            if kind == "text" or (self.max_calls is not None and i >= self.max_calls):
                continue
            if kind == "name":
                calls[i] = {"index": i, **call_dict(value, "")}
                self.num_calls[index] = i + 1
                open_calls.add(i)
            elif kind == "args":
                call = calls.get(i) or calls.setdefault(i, {"index": i, "function": {"arguments": ""}})
                call["function"]["arguments"] += value
            else:
                open_calls.discard(i)
        if index not in self.texted:  # whitespace waits for text (sent with it) or the end (sent if no calls)
            content = self.held.pop(index, "") + content
            if content.strip():
                self.texted.add(index)
            elif not finished or self.num_calls.get(index):
                if not finished:
                    self.held[index] = content
                content = ""
        if finished:
            self.complete[index] = bool(self.num_calls.get(index)) and not open_calls
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = list(calls.values())
        return delta
