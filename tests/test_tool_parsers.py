"""tool_choice "auto" (entrypoints/openai/tool_parsers.py): each parser splits a model's text into content and
tool calls, the same whole or streamed in any chunks; the server serves it behind vLLM's flags."""
from __future__ import annotations

import json

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


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_any_chunking_of_a_stream_gives_the_whole_texts_calls(parser, text, content, calls):
    """Every split into three chunks: the calls are the whole text's, each sent once, and the content sent is
    the whole text's, exactly (held-back tag prefixes included, once it is clear they are text; whitespace
    around calls only where there is other content)."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            tools = AutoToolCalls(parser)
            deltas = [tools.stream_delta(0, chunk, k == 2) for k, chunk in enumerate([text[:i], text[i:j], text[j:]])]
            sent_calls = [c for d in deltas for c in d.get("tool_calls", [])]
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent_calls] == calls
            assert [c["index"] for c in sent_calls] == list(range(len(calls)))
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
        calls = [c for d in deltas for c in d["delta"].get("tool_calls") or []]
        assert _calls(calls) == [("weather", {"city": "Verona"})] and deltas[-1]["finish_reason"] == "tool_calls"
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
        sent = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in sent] == [(0, "a")]
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
