"""tool_choice "auto" (entrypoints/openai/tool_parsers.py): each parser splits a model's text into content and
tool calls, the same whole or streamed in any chunks; the server serves it behind vLLM's flags."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from server_fixtures import ServerProcess, tiny_model_dir  # noqa: F401  (fixture)
from tokenmill.entrypoints.openai.tool_parsers import (AutoToolCalls, HermesParser, Llama3JsonParser, MistralParser,
                                                      PythonicParser)

HERMES = [
    ("Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Verona\"}}\n</tool_call>",
     "Let me look.\n", [("weather", {"city": "Verona"})]),
    ("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"b\", \"arguments\": "
     "{\"x\": [1, 2]}}</tool_call>", "\n", [("a", {}), ("b", {"x": [1, 2]})]),
    ("no calls here, only < and <tool", "no calls here, only < and <tool", []),
    ("<tool_call>{not json}</tool_call> then text", "<tool_call>{not json}</tool_call> then text", []),
    ("cut off <tool_call>{\"name\": \"a\", \"argu", "cut off <tool_call>{\"name\": \"a\", \"argu", []),
    ("\n\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n", "\n\n\n", [("a", {})]),  # no content
    ("  <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n Done. ", "  \n Done. ", [("a", {})]),
    ("  \n only whitespace first ", "  \n only whitespace first ", []),
    ("\n \n", "\n \n", []),
]
LLAMA3 = [
    ("{\"name\": \"weather\", \"parameters\": {\"city\": \"Mantua\"}}", "", [("weather", {"city": "Mantua"})]),
    ("<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"n\": 1}}", "",
     [("a", {}), ("b", {"n": 1})]),
    ("The weather is fine.", "The weather is fine.", []),
    ("Try it: {\"name\": \"a\", \"parameters\": {}}", "Try it: {\"name\": \"a\", \"parameters\": {}}", []),
    ("{\"not\": \"a call\"}", "{\"not\": \"a call\"}", []),
    ("{\"name\": \"q\", \"parameters\": {\"sql\": \"a; b\"}};{\"name\": \"r\", \"parameters\": {}}", "",
     [("q", {"sql": "a; b"}), ("r", {})]),  # a ";" inside a string does not split
]
PYTHONIC = [
    ("[get_weather(city='Padua', days=2), now()]", "", [("get_weather", {"city": "Padua", "days": 2}), ("now", {})]),
    ("<|python_start|>[f(a=[1, 2], b={'x': None, 'y': True})]<|python_end|>", "",
     [("f", {"a": [1, 2], "b": {"x": None, "y": True}})]),
    ("[f(1)]", "[f(1)]", []),  # positional arguments: not a call we can name
    ("[os.system('ls')]", "[os.system('ls')]", []),  # attributes are never calls (nothing is run either way)
    ("[f(a={1, 2})]", "[f(a={1, 2})]", []),  # a set has no JSON
    ("Here: [f()]", "Here: [f()]", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
]
MISTRAL = [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "",
     [("f", {"a": 1}), ("g", {})]),
    ('Sure. [TOOL_CALLS]f[ARGS]{"a": "b"}[TOOL_CALLS]g[ARGS]{}', "Sure. ", [("f", {"a": "b"}), ("g", {})]),
    ('[{"name": "f", "arguments": {"a": 1}}]', "", [("f", {"a": 1})]),  # the tag skipped as a special token
    ("[1, 2]", "[1, 2]", []),
    ("[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
    ("No calls [here].", "No calls [here].", []),
]
PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "pythonic": PythonicParser,
           "mistral": MistralParser}
CASES = ([("hermes", *c) for c in HERMES] + [("llama3_json", *c) for c in LLAMA3]
         + [("pythonic", *c) for c in PYTHONIC] + [("mistral", *c) for c in MISTRAL])


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_text_splits_into_content_and_calls(parser, text, content, calls):
    p = PARSERS[parser]()
    got_content, got_calls = p.extract(text)
    assert got_content == content and _calls(got_calls) == calls
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got_calls)


def _gather(deltas: list[dict]) -> list[dict]:
    """The calls a client builds from streamed deltas, joining pieces by index (as OpenAI's SDK does). Checks that
    each call's first piece carries its id, type and name, and the later ones only more arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:
                assert c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" and c["function"]["name"]
                calls[c["index"]] = {"id": c["id"], "name": c["function"]["name"],
                                     "arguments": c["function"]["arguments"], "pieces": 0}
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}, c
                calls[c["index"]]["arguments"] += c["function"]["arguments"]
            calls[c["index"]]["pieces"] += bool(c["function"]["arguments"])
    assert list(calls) == list(range(len(calls)))
    return [calls[i] for i in range(len(calls))]


def _named(calls: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments text) of a message's calls or _gather's."""
    return [(c["function"]["name"], c["function"]["arguments"]) if "function" in c else (c["name"], c["arguments"])
            for c in calls]


def _stream(parser: str, chunks: list[str], parallel: bool = True) -> tuple[AutoToolCalls, list[dict]]:
    tools = AutoToolCalls(parser, parallel)
    return tools, [tools.stream_delta(0, chunk, k == len(chunks) - 1) for k, chunk in enumerate(chunks)]


def _tokens(text: str) -> list[str]:
    """Token-like pieces: a word or one other character, each with the whitespace before it (special tags come
    in pieces too, which the parsers must hold back)."""
    return re.findall(r"\s*(?:\w+|[^\w\s])|\s+$", text)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_any_chunking_of_a_stream_gives_the_whole_texts_calls(parser, text, content, calls):
    """Every split into three chunks: the calls are the whole text's, each begun once (index, id, name) and its
    argument pieces joined exactly into the whole text's arguments; the content sent is the whole text's, exactly
    (held-back tag prefixes included, once it is clear they are text; whitespace around calls only where there is
    other content)."""
    whole = AutoToolCalls(parser).message(0, text)
    assert _calls(whole.get("tool_calls", [])) == calls
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            tools, deltas = _stream(parser, [text[:i], text[i:j], text[j:]])
            sent_calls = _gather(deltas)
            assert _named(sent_calls) == _named(whole.get("tool_calls", [])), (i, j, deltas)
            sent = "".join(d.get("content", "") for d in deltas)
            assert sent == (content if content.strip() or not calls else ""), (i, j, deltas)
            message = tools.message(0, text)
            assert message["content"] == (content if content.strip() or not calls else None)
            finish = tools.finish_reason(0, deltas[-1], "stop")
            assert finish == ("tool_calls" if calls else "stop")


def test_message_carries_calls_and_content():
    m = AutoToolCalls("hermes").message(0, HERMES[0][0])
    assert m["content"] == "Let me look.\n" and _calls(m["tool_calls"]) == HERMES[0][2]
    m = AutoToolCalls("hermes").message(0, HERMES[1][0])
    assert m["content"] is None  # only calls: null content, as OpenAI
    assert AutoToolCalls("hermes").message(0, "plain") == {"role": "assistant", "content": "plain"}


# arguments as a model writes them: a raw tab in a string (strict JSON's escape in the arguments), brackets and
# the starts of tags inside strings (held back, then sent once they turn out to be none)
WRITTEN = ('{"query": "weather in Verona", "days": [1, 2, 3], "opts": {"units": "metric", '
           '"note": "a \\"quoted\\" }]{ </tool <tool_call [TOOL [ARGS] tab\there"}}')
ARGS = WRITTEN.replace("\t", "\\t")
LONG = {  # name: (parser, text, content or None), each with the calls LONG_CALLS: (name, arguments text)
    "hermes": ("hermes", f'I will check.\n<tool_call>\n{{"name": "search", "arguments": {WRITTEN}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "I will check.\n\n"),
    "llama3_json": ("llama3_json", f'<|python_tag|>{{"name": "search", "parameters": {WRITTEN}}}; '
                    '{"name": "now", "parameters": {}}', None),
    "mistral": ("mistral", f'Sure. [TOOL_CALLS][{{"name": "search", "arguments": {WRITTEN}}}, '
                '{"name": "now", "arguments": {}}]', "Sure. "),
    "mistral_v11": ("mistral", f"Sure. [TOOL_CALLS]search[ARGS]{WRITTEN}[TOOL_CALLS]now[ARGS]{{}}", "Sure. "),
}
LONG_CALLS = [("search", ARGS), ("now", "{}")]


@pytest.mark.parametrize("chunking", ["chars", "tokens"])
@pytest.mark.parametrize("name", list(LONG))
def test_arguments_stream_as_they_are_written(name, chunking):
    """Token by token or a character at a time: a call's first delta carries its index, id, type and name, and its
    arguments then come in many pieces, as written (held back only while they could be the start of a tag),
    which join exactly into the whole text's arguments; two calls get indexes 0 and 1; the content is the text
    outside the calls; the finish reason is tool_calls."""
    parser, text, content = LONG[name]
    chunks = list(text) if chunking == "chars" else _tokens(text)
    assert "".join(chunks) == text
    tools, deltas = _stream(parser, chunks)
    calls = _gather(deltas)
    assert _named(calls) == LONG_CALLS and calls[0]["id"] != calls[1]["id"]
    assert calls[0]["pieces"] > 10  # it streams
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    whole = AutoToolCalls(parser).message(0, text)
    assert _named(whole["tool_calls"]) == LONG_CALLS and whole["content"] == content
    assert json.loads(ARGS)["opts"]["note"].endswith("tab\there")
    assert tools.finish_reason(0, deltas[-1], "stop") == "tool_calls"
    starts = [(k, c["index"]) for k, d in enumerate(deltas) for c in d.get("tool_calls", []) if "id" in c]
    assert [i for _, i in starts] == [0, 1]
    sent, start, read = "", text.index(WRITTEN), 0
    for k, d in enumerate(deltas):  # how far the arguments have gone out after each chunk
        sent += "".join(c["function"]["arguments"] for c in d.get("tool_calls", []) if c["index"] == 0)
        read += len(chunks[k])
        if 0 < read - start <= len(WRITTEN):
            written = WRITTEN[:read - start].replace("\t", "\\t")
            assert ARGS.startswith(sent) and len(sent) >= len(written) - len("</tool_call>"), (k, sent, written)
            if read - start < len(WRITTEN) // 2:
                assert starts[0][0] <= k  # the name went out before half the arguments were written


@pytest.mark.parametrize("chunking", ["chars", "tokens", "whole"])
def test_pythonic_calls_go_out_whole(chunking):
    """Pythonic calls are Python made JSON: each goes out whole (start and arguments in one piece) once the list is
    complete, with indexes 0 and 1, and the same arguments as the whole text's."""
    text = "[search(query='weather in Verona', days=[1, 2]), now()]"
    chunks = {"chars": list(text), "tokens": _tokens(text), "whole": [text]}[chunking]
    tools, deltas = _stream("pythonic", chunks)
    assert [d for d in deltas[:-1] if d] == []
    calls = _gather(deltas)
    expected = [("search", '{"query": "weather in Verona", "days": [1, 2]}'), ("now", "{}")]
    assert _named(calls) == expected == _named(AutoToolCalls("pythonic").message(0, text)["tool_calls"])
    assert [c["pieces"] for c in calls] == [1, 1] and tools.finish_reason(0, deltas[-1], "length") == "tool_calls"


@pytest.mark.parametrize("name", list(LONG))
def test_a_call_cut_off_is_the_same_whole_and_streamed(name):
    """Cut off (max_tokens) anywhere: the streamed calls and content are the whole text's. A call whose arguments
    had begun stays a call, with the arguments written so far; its finish reason stays "length" (it is not whole).
    Complete calls cut off after them report tool_calls. Text cut off before a call's arguments is content."""
    parser, text, _ = LONG[name]
    args_at = text.index(WRITTEN)
    for cut in range(0, len(text), 3):
        part = text[:cut]
        tools = AutoToolCalls(parser)
        whole = tools.message(0, part)
        whole_finish = tools.finish_reason(0, whole, "length")
        for chunks in (list(part), _tokens(part)):
            streamed, deltas = _stream(parser, chunks or [""])
            assert _named(_gather(deltas)) == _named(whole.get("tool_calls", [])), (cut, deltas)
            assert "".join(d.get("content", "") for d in deltas) == (whole["content"] or "")
            assert streamed.finish_reason(0, deltas[-1], "length") == whole_finish
        calls = _named(whole.get("tool_calls", []))
        if cut <= args_at:  # before the arguments begin: no call (the text so far is content)
            assert calls == [] and whole["content"] == part
        elif cut < args_at + len(WRITTEN):  # inside the first call's arguments
            assert calls == [("search", WRITTEN[:cut - args_at].replace("\t", "\\t"))], cut
        complete = bool(calls) and calls == LONG_CALLS[:len(calls)]
        assert whole_finish == ("tool_calls" if complete else "length"), cut


SHAPES = [  # hermes call objects as models write them: (object, calls: [] where the block is content)
    ('{"arguments": {"a": 1}, "name": "f"}', [("f", '{"a": 1}')]),  # arguments first: they go with the name
    ('{"name": "f", "arguments": "{\\"a\\": 1}"}', [("f", '{"a": 1}')]),  # a string's text is the arguments
    ('{"name": "f"}', [("f", "{}")]),
    ('{"name":"f","arguments":{"a":1}}', [("f", '{"a":1}')]),  # as written: compact stays compact
    ('{"name": "f", "arguments": {\n  "a": [1,\n 2]\n}\n}', [("f", '{\n  "a": [1,\n 2]\n}')]),
    ('{"name": "f", "arguments": {"a": "line\nbreak"}}', [("f", '{"a": "line\\nbreak"}')]),  # raw: escaped
    ('{"name": "f", "arguments": {"a": 1}', [("f", '{"a": 1}')]),  # the object's own brace forgotten
    ('{"name": "f", "arguments": {"a": 1}} oops', [("f", '{"a": 1}')]),  # not read after the call
    ('{"name": "f", "arguments": {"a": 1} oops}', [("f", '{"a": 1}')]),  # malformed after the arguments
    ('{"name": "f", "arguments": {"a": 1 oops}}', [("f", '{"a": 1 oops}')]),  # a call: arguments as written
    ('{"name": "f", "arguments": {}}\n{"name": "g", "arguments": {"b": 2}}', [("f", "{}"), ("g", '{"b": 2}')]),
    ('{"name": "", "arguments": {}}', []),
    ('{"name": 5, "arguments": {}}', []),
    ('{"name": ["f"], "arguments": {}}', []),
    ('{"arguments": {}}', []),
    ('{"name" "f", "arguments": {}}', []),
    ('["f", {}]', []),
]


@pytest.mark.parametrize("obj, calls", SHAPES)
def test_call_object_shapes_whole_and_streamed(obj, calls):
    text = f"Hi <tool_call>\n{obj}\n</tool_call>"
    whole = AutoToolCalls("hermes").message(0, text)
    assert _named(whole.get("tool_calls", [])) == calls
    assert whole["content"] == ("Hi " if calls else text)
    for chunks in (list(text), _tokens(text), [text]):
        tools, deltas = _stream("hermes", chunks)
        assert _named(_gather(deltas)) == calls
        assert "".join(d.get("content", "") for d in deltas) == whole["content"]
        assert tools.finish_reason(0, deltas[-1], "stop") == ("tool_calls" if calls else "stop")


def test_text_after_llama3_calls_is_content():
    """Llama 3's calls are the whole output: a first object that is no call makes it all content; text after
    complete calls that begins none is content from there on (whole and streamed)."""
    for text, content, calls in (
            ('{"name": "f", "parameters": {"a": 1}} and then text', " and then text", [("f", '{"a": 1}')]),
            ('{"name": "f", "parameters": {}}; {"no": "call"}', '; {"no": "call"}', [("f", "{}")]),
            ('{"no": "call"}; {"name": "f", "parameters": {}}', '{"no": "call"}; {"name": "f", "parameters": {}}', []),
            ('<|python_tag|>', "<|python_tag|>", [])):
        whole = AutoToolCalls("llama3_json").message(0, text)
        assert (whole["content"], _named(whole.get("tool_calls", []))) == (content, calls)
        for chunks in (list(text), _tokens(text)):
            _, deltas = _stream("llama3_json", chunks)
            assert _named(_gather(deltas)) == calls
            assert "".join(d.get("content", "") for d in deltas) == content


def test_finish_reason_for_calls_cut_by_max_tokens():
    """Complete calls, then the output ran into max_tokens: tool_calls (the calls are whole and usable, as vLLM);
    a call cut off in its arguments keeps "length", and an output that stopped inside one keeps "stop": the client
    must not run it. Whole and streamed agree."""
    complete = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\nNow I will also'
    cut = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"b'
    for text, finish, expected in ((complete, "length", "tool_calls"), (complete, "stop", "tool_calls"),
                                   (cut, "length", "length"), (cut, "stop", "stop"), (complete, "abort", "abort")):
        tools = AutoToolCalls("hermes")
        assert tools.finish_reason(0, tools.message(0, text), finish) == expected
        tools, deltas = _stream("hermes", _tokens(text))
        assert tools.finish_reason(0, deltas[-1], finish) == expected
    tools = AutoToolCalls("hermes", parallel=False)  # the cut call is dropped: the one kept is whole
    assert tools.finish_reason(0, tools.message(0, cut), "length") == "tool_calls"
    assert AutoToolCalls("hermes").message(0, cut)["tool_calls"][1]["function"]["arguments"] == '{"b'


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# the tiny random model writes what the regex lets it: here a Hermes call, to exercise the whole path
CALL_TEXT = '<tool_call>\n{"name": "weather", "arguments": {"city": "Verona"}}\n</tool_call>'


def test_the_server_serves_auto_tool_choice_behind_the_flags(tiny_model_dir, tmp_path):  # noqa: F811
    srv = ServerProcess(tiny_model_dir, tmp_path / "server.log", "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes", "--trust-request-chat-template")
    try:
        srv.wait_ready()
        # (this server also trusts requests' own chat templates: one renders the prompt, in chat and /tokenize)
        own = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "user", "content": "more"}],
               # loop controls and transformers' {% generation %} tag: they compile as transformers compiles them
               "chat_template": "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                                "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}!"}
        ids = httpx.post(srv.url + "/tokenize", json=own, timeout=60).json()["tokens"]
        assert ids == httpx.post(srv.url + "/tokenize", json={"prompt": "Weather?!", "add_special_tokens": False},
                                 timeout=60).json()["tokens"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={**own, "max_tokens": 2}, timeout=60).json()
        assert r["usage"]["prompt_tokens"] == len(ids)
        bad = httpx.post(srv.url + "/v1/chat/completions", json={**own, "chat_template": "{% for %}"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template"
        body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS, "max_tokens": 80,
                "temperature": 0, "structured_outputs": {"regex": CALL_TEXT.replace("{", "\\{").replace("}", "\\}")}}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", r
        assert _calls(choice["message"]["tool_calls"]) == [("weather", {"city": "Verona"})]
        assert choice["message"]["content"] is None
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        deltas = [e["choices"][0] for e in events if e["choices"]]
        streamed = _gather([d["delta"] for d in deltas])
        assert _named(streamed) == _named(choice["message"]["tool_calls"]) and streamed[0]["pieces"] > 1, deltas
        assert deltas[-1]["finish_reason"] == "tool_calls"
        for max_tokens in (12, 50, 60):  # cut off (here: before, in and after the arguments): streamed as whole
            cut = {**body, "max_tokens": max_tokens}
            whole = httpx.post(srv.url + "/v1/chat/completions", json=cut, timeout=60).json()["choices"][0]
            with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**cut, "stream": True}, timeout=60) as s:
                deltas = [json.loads(line[6:])["choices"][0] for line in s.iter_lines() if line.startswith("data: {")]
            calls = _named(whole["message"].get("tool_calls") or [])
            assert _named(_gather([d["delta"] for d in deltas])) == calls
            assert "".join(d["delta"].get("content") or "" for d in deltas) == (whole["message"]["content"] or "")
            assert deltas[-1]["finish_reason"] == whole["finish_reason"], (whole, deltas)
            usable = calls == [("weather", '{"city": "Verona"}')]  # else cut off: no call, or its arguments' start
            assert whole["finish_reason"] == ("tool_calls" if usable else "length"), whole
        two = CALL_TEXT + "\n" + CALL_TEXT.replace("Verona", "Padua")
        single = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            **body, "max_tokens": 160, "parallel_tool_calls": False,
            "structured_outputs": {"regex": two.replace("{", "\\{").replace("}", "\\}")}}).json()["choices"][0]
        assert _calls(single["message"]["tool_calls"]) == [("weather", {"city": "Verona"})], single
        plain = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
            **body, "structured_outputs": {"choice": ["It is sunny."]}}).json()["choices"][0]
        assert plain["message"] == {"role": "assistant", "content": "It is sunny."}
        assert plain["finish_reason"] == "stop"
    finally:
        assert srv.terminate() == 0, srv.logs()


def test_auto_tool_choice_needs_a_parser():
    from tokenmill.entrypoints.cli import main

    assert main(["serve", "--enable-auto-tool-choice", "--port", "1"]) == 2


def test_required_calls_take_pydantic_style_defs_and_lenient_json():
    """Tools whose schemas refer to their own $defs (pydantic's shape) compile under "required" (the definitions
    move to the root, where #/$defs/... resolves); two tools defining one name differently are a 400; a call
    list with a raw control character in a string still parses into calls."""
    from tokenmill.entrypoints.openai.errors import APIError
    from tokenmill.entrypoints.openai.structured import ForcedToolCalls
    from tokenmill.sample.grammar import GrammarCompiler
    from test_structured_outputs import SHIPPED
    from tokenmill.engine.input_processor import load_tokenizer

    unit = {"$defs": {"Unit": {"enum": ["C", "F"]}}, "type": "object", "required": ["unit"],
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}}
    tools = [{"type": "function", "function": {"name": "temp", "parameters": unit}},
             {"type": "function", "function": {"name": "wind", "parameters": {**unit, "properties": {
                 "unit": {"$ref": "#/$defs/Unit"}, "gusts": {"type": "boolean"}}}}}]
    forced = ForcedToolCalls(tools, "required")
    compiled = GrammarCompiler(load_tokenizer(str(SHIPPED)), 4096).compile(forced.grammar)
    import xgrammar
    assert xgrammar.GrammarMatcher(compiled).accept_string('[{"name": "temp", "parameters": {"unit": "C"}}]')
    assert not xgrammar.GrammarMatcher(compiled).accept_string('[{"name": "temp", "parameters": {"unit": "K"}}]')
    clash = [tools[0], {"type": "function", "function": {"name": "x", "parameters": {
        "$defs": {"Unit": {"enum": ["K"]}}, "type": "object"}}}]
    with pytest.raises(APIError, match="differently"):
        ForcedToolCalls(clash, "required")
    calls = forced.calls('[{"name": "temp", "parameters": {"unit": "C\x10"}}]')
    assert calls and json.loads(calls[0]["function"]["arguments"]) == {"unit": "C\x10"}


def test_parallel_tool_calls_false_allows_one_call():
    """OpenAI's parallel_tool_calls false: "required" calls are held to one by the grammar (nothing generated
    past it); "auto" answers keep their first call only, whole and streamed in any chunking (as vLLM)."""
    import xgrammar

    from test_structured_outputs import SHIPPED
    from tokenmill.entrypoints.openai.structured import ForcedToolCalls
    from tokenmill.sample.grammar import GrammarCompiler
    from tokenmill.tokenizer import load_tokenizer

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    compiler = GrammarCompiler(load_tokenizer(str(SHIPPED)), 4096)
    two = '[{"name": "f", "parameters": {}}, {"name": "f", "parameters": {}}]'
    for parallel in (True, False):
        compiled = compiler.compile(ForcedToolCalls(tools, "required", parallel).grammar)
        assert xgrammar.GrammarMatcher(compiled).accept_string('[{"name": "f", "parameters": {}}]')
        assert xgrammar.GrammarMatcher(compiled).accept_string(two) == parallel
    text = HERMES[1][0]  # two calls, a and b
    assert _calls(AutoToolCalls("hermes", parallel=False).message(0, text)["tool_calls"]) == [("a", {})]
    assert len(AutoToolCalls("hermes").message(0, text)["tool_calls"]) == 2
    for i in range(0, len(text) + 1, 5):
        tools_ = AutoToolCalls("hermes", parallel=False)
        deltas = [tools_.stream_delta(0, text[:i], False), tools_.stream_delta(0, text[i:], True)]
        assert _named(_gather(deltas)) == [("a", "{}")]
        assert tools_.finish_reason(0, deltas[-1], "stop") == "tool_calls"


def test_schemas_with_definitions_and_malformed_tools_or_choices():
    """"required" hoists `definitions` as it does `$defs` (#/definitions/A resolves at the root); a `$defs`
    that is no object, a tool_choice whose name is no string, and a tool name that is no UTF-8 text are 400s,
    not 500s."""
    import xgrammar

    from test_structured_outputs import SHIPPED
    from tokenmill.entrypoints.openai.errors import APIError
    from tokenmill.entrypoints.openai.structured import ForcedToolCalls
    from tokenmill.sample.grammar import GrammarCompiler
    from tokenmill.tokenizer import load_tokenizer

    params = {"type": "object", "definitions": {"A": {"type": "string", "enum": ["x", "y"]}},
              "required": ["a"], "properties": {"a": {"$ref": "#/definitions/A"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    compiled = GrammarCompiler(load_tokenizer(str(SHIPPED)), 4096).compile(ForcedToolCalls(tools, "required").grammar)
    assert xgrammar.GrammarMatcher(compiled).accept_string('[{"name": "f", "parameters": {"a": "y"}}]')
    assert not xgrammar.GrammarMatcher(compiled).accept_string('[{"name": "f", "parameters": {"a": "z"}}]')
    for bad_tools, choice, field in (
            ([{"type": "function", "function": {"name": "f", "parameters": {"$defs": "x"}}}], "required", "tools"),
            ([{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}], "required", "tools"),
            (tools, {"type": "function", "function": {"name": ["f"]}}, "tool_choice"),
            (tools, {"type": "function", "function": {"name": {"f": 1}}}, "tool_choice"),
            ([{"type": "function", "function": {"name": "\ud83d"}}], "required", "tools")):
        with pytest.raises(APIError) as e:
            ForcedToolCalls(bad_tools, choice)
        assert e.value.status == 400 and e.value.param == field


def test_a_lone_surrogate_escape_in_a_call_still_gives_utf8_text():
    """A model that writes half a surrogate pair as a JSON escape: the arguments keep it as an ASCII escape (the
    response must be UTF-8); a name that holds one is no call, its text stays content."""
    for parser, key in ((HermesParser(), "arguments"), (Llama3JsonParser(), "parameters")):
        call = '{"name": "get", "%s": {"q": "\\ud83d ok \u00e9"}}' % key
        text = f"<tool_call>{call}</tool_call>" if isinstance(parser, HermesParser) else call
        content, calls = parser.extract(text)
        args = calls[0]["function"]["arguments"]
        args.encode("utf-8")
        assert json.loads(args) == {"q": "\ud83d ok \u00e9"} and "\u00e9" in args
        bad_name = text.replace('"get"', '"\\udc00"')
        assert parser.extract(bad_name) == (bad_name, [])
    from tokenmill.entrypoints.openai.structured import ForcedToolCalls

    forced = ForcedToolCalls([{"type": "function", "function": {"name": "get"}}], "required")
    assert json.loads(forced.calls('[{"name": "get", "parameters": {"q": "\\udc00"}}]')[0]["function"]["arguments"]) \
        == {"q": "\udc00"}
    assert forced.calls('[{"name": "\\udc00", "parameters": {}}]') is None


def test_the_cli_offers_every_parser():
    import argparse

    from tokenmill.entrypoints.openai.cli_args import add_server_args
    from tokenmill.entrypoints.openai.tool_parsers import TOOL_PARSERS

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    choices = next(a.choices for a in parser._actions if a.dest == "tool_call_parser")
    assert sorted(choices) == sorted(TOOL_PARSERS)


def test_the_mistral_parser_keeps_the_special_tokens_it_reads():
    """[TOOL_CALLS] and [ARGS] are special tokens in Mistral's tokenizers: with skip_special_tokens they would
    vanish from the text, and 'f{...}' is no call. The server keeps them for this parser only."""
    assert AutoToolCalls("mistral").keeps_special_tokens
    assert not any(AutoToolCalls(p).keeps_special_tokens for p in ("hermes", "llama3_json", "pythonic"))
    assert MistralParser().extract('f{"a": 1}') == ('f{"a": 1}', [])  # what stripped tags would leave
