"""A request's grammar from the OpenAI fields that ask for one, and forced tool calls.

    response_format {"type": "json_object"}               -> any JSON object
    response_format {"type": "json_schema", ...schema}   -> that schema
    response_format {"type": "structural_tag", ...}      -> vLLM's structural tag (format, or structures
                                                             and triggers)
    structured_outputs {...} / guided_json, guided_regex,  -> as vLLM takes them (one per request)
      guided_choice, guided_grammar
    tool_choice {"type": "function", "function": {name}} -> that tool's parameters; the text is its arguments
    tool_choice "required"                                -> a JSON array of {"name", "parameters"}, one item
                                                             per call, each of a tool's own schema (as vLLM)

tool_choice "auto" is the model's own text, read by tool_parsers.py (serving_chat.py picks which)."""
from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.errors import APIError, bad_request
from tokenmill.entrypoints.openai.tool_parsers import call_dict
from tokenmill.sampling_params import JSON_KINDS, STRUCTURED_FLAGS, STRUCTURED_KINDS, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_grammar(req, tool_grammar: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
    """The one grammar a request asks for (None: none); a 400 for two, or for one that is malformed."""
    asked = _asked(req, tool_grammar)
    if not asked:
        return None
    if len(asked) > 1:
        raise APIError(400, f"one grammar per request: got {', '.join(name for name, _ in asked)}", asked[1][0])
    name, spec = asked[0]
    if isinstance(spec, StructuredOutputsParams):
        return spec
    try:
        params = StructuredOutputsParams(**spec)
    except TypeError:
        raise APIError(400, f"'{name}' takes {', '.join(STRUCTURED_KINDS + STRUCTURED_FLAGS)}", name) from None
    except ValueError as e:
        raise bad_request(str(e).replace("'structured_outputs'", f"'{name}'"), name) from None
    if req.guided_whitespace_pattern is not None and params.kind in JSON_KINDS:  # (elsewhere it means nothing)
        raise APIError(400, "'guided_whitespace_pattern' is not supported (the grammar backend has no whitespace "
                            "regex); 'disable_any_whitespace': true allows none but the separators",
                       "guided_whitespace_pattern")
    return params


def grammar_field(req, tool_grammar: StructuredOutputsParams | None = None) -> str | None:
    """The request field its grammar came in (what a 400 for a grammar the engine refuses names; a forced call's
    grammar is made of the tools' schemas)."""
    asked = _asked(req, tool_grammar)
    return None if not asked else "tools" if asked[0][0] == "tool_choice" else asked[0][0]


def _asked(req, tool_grammar: StructuredOutputsParams | None) -> list[tuple[str, Any]]:
    """(field, grammar) for every field of `req` that asks for a grammar."""
    asked: list[tuple[str, Any]] = []
    if req.structured_outputs is not None:
        asked.append(("structured_outputs", req.structured_outputs))
    for name, kind in _GUIDED.items():
        if getattr(req, name) is not None:
            asked.append((name, {kind: getattr(req, name)}))
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.json_schema is None):
            raise APIError(400, "response_format 'json_schema' needs json_schema.schema", "response_format")
        elif fmt.type == "json_schema":
            asked.append(("response_format", {"json": fmt.json_schema.json_schema}))
        else:  # structural_tag, checked where the engine checks structured_outputs' (a 400 naming response_format)
            tag = {"structures": fmt.structures, "triggers": fmt.triggers} if fmt.structures is not None else \
                {"format": fmt.format}
            asked.append(("response_format", {"structural_tag": tag}))
    if tool_grammar is not None:
        asked.append(("tool_choice", tool_grammar))
    return asked


def tool_functions(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema, for OpenAI's tool list; a 400 for a malformed one."""
    out = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _is_text(fn["name"]):
            raise APIError(400, "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': "
                                "...}}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tool {fn['name']!r}: 'parameters' must be a JSON schema object", "tools")
        out[fn["name"]] = params or {"type": "object", "properties": {}}
    return out


def _is_text(name: str) -> bool:
    """Non-empty and UTF-8 (no lone surrogate, which a JSON escape can make and no response could carry)."""
    try:
        return bool(name) and bool(name.encode("utf-8"))
    except UnicodeEncodeError:
        return False


_DEF_KEYS = ("$defs", "definitions")  # where schemas keep what "#/$defs/Name" and "#/definitions/Name" refer to


def _hoist_defs(functions: dict[str, dict]) -> dict:
    """The tools' `$defs` and `definitions` (pydantic's schemas refer to them as #/$defs/Name, older ones as
    #/definitions/Name), moved to the root of the combined schema, where those references resolve; two tools
    that define one name differently are a 400 (as vLLM)."""
    hoisted: dict = {}
    for name, params in functions.items():
        for where in _DEF_KEYS:
            own = params.get(where)
            if own is None:
                continue
            if not isinstance(own, dict):
                raise APIError(400, f"tool {name!r}: '{where}' must be an object of schemas", "tools")
            functions[name] = params = {k: v for k, v in params.items() if k != where}
            defs = hoisted.setdefault(where, {})
            for key, value in own.items():
                if defs.setdefault(key, value) != value:
                    raise APIError(400, f"tools define '{where}/{key}' differently; 'required' puts every tool's "
                                        "definitions in one schema", "tools")
    return hoisted


class ForcedToolCalls:
    """tool_choice "required" or a named function: the grammar that forces the call(s), and the message fields
    the output text turns into."""

    def __init__(self, tools: list[dict], tool_choice, parallel: bool = True):
        functions = tool_functions(tools)
        if tool_choice == "required":
            self.name = None
            defs = _hoist_defs(functions)
            items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p}}
                     for n, p in functions.items()]
            # parallel_tool_calls false: the grammar allows one call (nothing generated past it, unlike vLLM)
            schema = {"type": "array", "minItems": 1, **({} if parallel else {"maxItems": 1}),
                      "items": {"anyOf": items}, **defs}
        else:
            fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
            self.name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(self.name, str) or self.name not in functions:
                raise APIError(400, f"tool_choice names function {self.name!r}, which is not in 'tools'", "tool_choice")
            schema = functions[self.name]
        # compact JSON, as OpenAI's arguments come (and no room for a model to pad a call with whitespace)
        self.grammar = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
        self.texts: dict[int, str] = {}  # per choice: the text streamed so far

    def finish_reason(self, index: int, message_or_delta: dict, finish: str | None) -> str | None:
        """What a finished choice that called tools reports: OpenAI's "tool_calls" for required calls, the
        output's own ("stop") for a named function, as vLLM."""
        if self.name is None and finish == "stop" and message_or_delta.get("tool_calls"):
            return "tool_calls"
        return finish

    def calls(self, text: str) -> list[dict] | None:
        """The tool calls a choice's whole text makes; None where the text is not a whole call list (it was cut
        by max_tokens or a stop string: the text is then the content)."""
        if self.name is not None:  # (no text: a reasoning model cut off before its answer)
            return [call_dict(self.name, text)] if text else None
        try:  # (strict=False: a raw control character in a string, which some grammars let through, is kept)
            parsed = json.loads(text, strict=False)
            return [call_dict(c["name"], c["parameters"]) for c in parsed]
        except (ValueError, TypeError, KeyError):
            return None

    def message(self, index: int, text: str) -> dict:
        calls = self.calls(text)
        if calls is None:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": "", "tool_calls": calls}

    def stream_delta(self, index: int, text: str, finished: bool) -> dict:
        """A streamed chunk's delta. A named function streams its arguments as they come (the first chunk
        carries the call's id and name); required calls go out whole with the last chunk, since their JSON
        must be complete to split."""
        if self.name is not None and index not in self.texts and not text:
            return {}  # the call opens with its first text (a reasoning model may think first, and be cut off)
        first = index not in self.texts
        whole = self.texts[index] = self.texts.get(index, "") + text
        if self.name is not None:
            if first:
                return {"tool_calls": [{"index": 0, **call_dict(self.name, text)}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}
        if not finished:
            return {}
        calls = self.calls(whole)
        if calls is None:
            return {"content": whole}
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
