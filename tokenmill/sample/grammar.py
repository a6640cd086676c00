"""Structured outputs: the tokens a request's grammar allows next, as a mask the sampler applies.

A request's `StructuredOutputsParams` (sampling_params.py: a JSON schema, any JSON object, a regex, a choice
of strings or an EBNF grammar) compiles once per process through xgrammar (compiled grammars are cached by
their text), and each request gets a matcher that walks its output tokens. Before each step that samples for
it, the matcher catches up with the tokens sampled since, then writes the allowed tokens as a bitmask:

    bitmask   int32 [ceil(vocab / 32)]: bit b of word w set  <=>  token 32 * w + b is allowed
    unpacked  bool  [vocab]            (apply_token_masks, on the logits' device; disallowed -> -inf)

The matcher lives on the worker beside the request's other state (worker/request_state.py), so the scheduler
and the step messages stay as they are; every rank that samples (the last pipeline stage, each of its TP ranks)
walks the same tokens and makes the same masks. Such a request takes no argmax-only fast path
(SamplingParams.argmax_only). With speculative decoding its drafts are cut at the first token the grammar
refuses (`valid_drafts`), and a verification of k drafts gets k + 1 masks, row j's after drafts 1..j
(`draft_bitmasks`): the matcher steps through the drafts, then rolls back, as vLLM's does."""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import threading

import torch

from tokenmill.device_copy import device_tensor, to_device
from tokenmill.sampling_params import StructuredOutputsParams

logger = logging.getLogger("tokenmill")
BITS = 32
# JSON's whitespace between two elements, at most: room for pretty-printing (a newline and 5 levels of 4-space
# indent), and a bound on a model that would otherwise emit whitespace until max_tokens (small models do)
MAX_JSON_WHITESPACE = 24


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer and logits width. A worker passes `load_tokenizer` (a function that
    loads it) instead of the tokenizer: it pays for one only once a structured request arrives."""

    def __init__(self, tokenizer, vocab_size: int, load_tokenizer=None, cache_bytes: int = 512 << 20):
        self._tokenizer, self._load, self.vocab_size = tokenizer, load_tokenizer, vocab_size
        self.cache_bytes = cache_bytes  # xgrammar's cache of compiled grammars (unbounded by default), as vLLM's
        self._lock = threading.Lock()  # compiles may come from the engine's thread and the precompile thread
        self._made = None

    @property
    def made(self) -> bool:
        """Whether the tokenizer's info is built (the first compile builds it, reading the tokenizer)."""
        return self._made is not None

    @property
    def _compiler(self):
        with self._lock:
            if self._made is None:
                self._made = self._make()
            return self._made

    def _make(self):
        import xgrammar

        tok = self._load() if self._load is not None else self._tokenizer
        if tok is None:
            raise ValueError("structured outputs need a tokenizer (skip_tokenizer_init=True was set)")
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
        _check_tokens_concatenate(tok, info)
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=self.cache_bytes)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar (cached by xgrammar); ValueError naming the field for a spec it cannot take."""
        c = self._compiler
        with _refusing(spec):
            kind, text = _source(spec)
            return c.compile_regex(text) if kind == "regex" else c.compile_grammar(text)

    def validate(self, spec: StructuredOutputsParams) -> None:
        """ValueError, as `compile`'s, for a spec xgrammar cannot parse, without compiling it against the
        vocabulary (the costly part, which the engine does once): what the front end needs to refuse a request.
        The tokenizer's check runs too, once. Parses are cached: the server checks a request's grammar twice
        (before its prompts are processed, and with each), and a wide schema takes tens of ms to parse."""
        self._compiler  # noqa: B018  (the tokenizer's info, and its check)
        with _refusing(spec):
            _parse(*_source(spec))

    def matcher(self, spec: StructuredOutputsParams, stop_token_ids: list[int]) -> "RequestGrammar":
        return RequestGrammar(self.compile(spec), stop_token_ids, self.vocab_size, spec.start_after)


class RequestGrammar:
    """One request's matcher, and how many of its output tokens it has taken."""

    def __init__(self, compiled, stop_token_ids: list[int], vocab_size: int, start_after: tuple[int, ...] = ()):
        import xgrammar

        stops = [t for t in stop_token_ids if 0 <= t < vocab_size]  # (an id past the vocabulary: never sampled)
        self._matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        self._vocab_size = vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        # every bit but the stop tokens': a mask with none of these set allows nothing but stopping
        self._not_stop = torch.full_like(self._bitmask[0], -1)
        for t in self._matcher.stop_token_ids:
            if t < vocab_size:  # (bit 31 is int32's sign bit: ~(1 << 31) would not fit)
                self._not_stop[t // BITS] &= ~(1 << (t % BITS)) if t % BITS < BITS - 1 else 2**31 - 1
        self._draft_buf = self._bitmask[:0]  # verifications' k + 1 rows (draft_bitmasks), grown on demand
        self.consumed = 0
        self.broken = False  # a token the grammar refused (none should reach it): masking stops, with a warning
        # a thinking model's end tag: the output is free until it has these tokens, and held from there on
        self._after, self.waiting = tuple(start_after), bool(start_after)

    def _start_at(self, tokens: list[int], since: int) -> int | None:
        """Where the grammar starts in `tokens` (the index after the first `start_after` run ending at or past
        `since`), or None while the run has not come."""
        n = len(self._after)
        for end in range(max(since, n), len(tokens) + 1):
            if tuple(tokens[end - n:end]) == self._after:
                return end
        return None

    def _catch_up(self, output_token_ids: list[int]) -> None:
        """The matcher takes the output tokens sampled since its last call (those after the start, if it waits)."""
        if self.waiting:
            start = self._start_at(output_token_ids, self.consumed)
            if start is None:
                self.consumed = len(output_token_ids)
                return
            self.waiting, self.consumed = False, start
        m = self._matcher
        for tok in output_token_ids[self.consumed:]:
            if self.broken or m.is_terminated():
                break
            if not m.accept_token(tok):
                self.broken = True
                logger.warning("a structured-output request sampled token %d, which its grammar refuses; "
                               "its remaining tokens are not constrained", tok)
        self.consumed = len(output_token_ids)

    @property
    def _done(self) -> bool:
        """Done with: it took a stop token (a request with ignore_eos goes on unconstrained), or broken."""
        return self.broken or self._matcher.is_terminated()

    def next_bitmask(self, output_token_ids: list[int]) -> torch.Tensor | None:
        """The allowed next tokens after `output_token_ids` (int32 [words], on the host: the matcher's own buffer,
        valid until its next call); None once the grammar is done with."""
        self._catch_up(output_token_ids)
        if self.waiting or self._done:
            return None
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0]

    def _draft_start(self, output_token_ids: list[int], drafts: list[int]) -> int | None:
        """The first j where output + drafts[:j] holds the grammar's start (0 when it has started); None: not within
        these drafts."""
        if not self.waiting:
            return 0
        keep = min(len(self._after) - 1, len(output_token_ids))  # a run that began before the drafts
        tail = list(output_token_ids[len(output_token_ids) - keep:]) if keep else []
        start = self._start_at(tail + list(drafts), keep)
        return None if start is None else start - keep

    def draft_bitmasks(self, output_token_ids: list[int], drafts: list[int]
                       ) -> list[tuple[torch.Tensor | None, bool]]:
        """A verification's k + 1 rows: per row j, (the tokens allowed after `output_token_ids` + drafts[:j], or
        None where unconstrained; whether it allows stop tokens only). The matcher walks the drafts, then rolls
        back. Rows past a refused draft are never emitted from (the mask before it bans that draft): None."""
        self._catch_up(output_token_ids)
        m, n = self._matcher, len(drafts) + 1
        first = self._draft_start(output_token_ids, drafts)
        if first is None:
            return [(None, False)] * n
        if self._draft_buf.shape[0] < n:
            import xgrammar
            self._draft_buf = xgrammar.allocate_token_bitmask(n, self._vocab_size)
        rows, taken = [(None, False)] * first, 0  # rows before the grammar starts are free
        for j in range(first, n):
            if self.broken or m.is_terminated():
                break
            m.fill_next_token_bitmask(self._draft_buf, j)
            mask = self._draft_buf[j]
            rows.append((mask, self.only_stops(mask)))
            if j == n - 1 or not m.accept_token(drafts[j]):
                break
            taken += 1
        if taken:
            m.rollback(taken)
        return rows + [(None, False)] * (n - len(rows))

    def valid_drafts(self, output_token_ids: list[int], drafts: list[int]) -> list[int]:
        """`drafts` up to the first token the grammar refuses after `output_token_ids` (all of them once the
        grammar is done with: the request goes on unconstrained); the matcher is left where it was."""
        self._catch_up(output_token_ids)
        first = self._draft_start(output_token_ids, drafts)
        if first is None:
            return list(drafts)
        m, taken, kept = self._matcher, 0, len(drafts)
        for j, d in enumerate(drafts[first:], start=first):
            if self._done:
                break
            if not m.accept_token(d):
                kept = j
                break
            taken += 1
        if taken:
            m.rollback(taken)
        return list(drafts[:kept])

    def only_stops(self, bitmask: torch.Tensor) -> bool:
        """Whether `bitmask` allows stop tokens only (the grammar is complete): min_tokens then gives way, since
        banning them would leave no token to sample. (A grammar that could not end here allows no stop token.)"""
        return self._matcher.is_completed() and not bool((bitmask & self._not_stop).any())


def apply_token_masks(logits: torch.Tensor, rows: list[int], bitmasks: list[torch.Tensor]) -> None:
    """In place: the tokens each row's bitmask leaves out get -inf, for all masked rows in one write. The
    bitmasks go to the device packed (vocab / 8 bytes a row) and are unpacked there."""
    dev, vocab = logits.device, logits.shape[-1]
    packed = to_device(torch.stack(bitmasks), dev)
    shifts = torch.arange(BITS, dtype=torch.int32, device=dev)
    banned = ((packed.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, :vocab] == 0
    if len(rows) == logits.shape[0]:  # every row masked (rows are distinct and increasing): in place
        logits.masked_fill_(banned, float("-inf"))
        return
    at = device_tensor(rows, torch.int64, dev)
    logits.index_copy_(0, at, logits.index_select(0, at).masked_fill(banned, float("-inf")))


# xgrammar's JSON grammars let length-bounded strings (minLength / maxLength) hold raw control characters, which
# JSON forbids (mlc-ai/xgrammar#286; its unbounded strings exclude them): those strings' class, and ours
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


@functools.lru_cache(maxsize=256)
def json_grammar(schema: str, any_whitespace: bool) -> str:
    """A JSON schema's grammar, as EBNF text for xgrammar (whose compiler caches it by that text)."""
    import xgrammar

    if any_whitespace:
        g = xgrammar.Grammar.from_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    else:
        g = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False)
    return str(g).replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


# a schema nested deeper than this many brackets is refused: xgrammar's compile time grows fast with depth
# (500 levels take seconds, 2,000 minutes), and no real schema comes near it (a pydantic model 10 deep: ~20)
MAX_SCHEMA_DEPTH = 64


def _check_depth(schema: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """Refuse a schema nested past `limit`, counted over its text's brackets (outside strings)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in schema:
        if in_string:
            escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > limit:
        raise ValueError(f"the schema nests {deepest} brackets deep; at most {limit} are taken")


def compile_threads() -> int:
    """Threads that compile (or parse) grammars side by side, as vLLM's pool: at least two, so that one slow
    compile, which cannot be stopped once running (even for a request that is gone), holds up no other."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


# groups nested deeper than this in any regex a request carries (a regex, a schema's patterns, a grammar's
# Regex("...")) are refused: xgrammar recurses over them and, in the tens of thousands, overflows its stack (a
# segfault that took the server down); no real pattern comes near it
MAX_REGEX_NESTING = 256


@functools.lru_cache(maxsize=256)
def _check_nesting(text: str, what: str) -> None:
    """Refuse `text` whose parentheses nest past MAX_REGEX_NESTING (escaped ones left out)."""
    depth = deepest = 0
    for m in re.finditer(r"[()]", re.sub(r"\\.", "", text)):
        depth = depth + 1 if m.group() == "(" else max(0, depth - 1)
        deepest = max(deepest, depth)
    if deepest > MAX_REGEX_NESTING:
        raise ValueError(f"{what} nests {deepest} groups deep; at most {MAX_REGEX_NESTING} are taken")


# keywords xgrammar drops without a word (its outputs then break them): refused, naming the keyword, as vLLM
# refuses the ones it knows of for xgrammar
_DROPPED_KEYWORDS = ("contains", "minContains", "maxContains", "not", "if", "then", "else", "dependentRequired",
                     "dependentSchemas", "dependencies")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems")


@functools.lru_cache(maxsize=256)
def _check_schema_keywords(schema: str) -> None:
    _check_keywords(json.loads(schema), "#")


def _check_keywords(node, path: str) -> None:
    if isinstance(node, list):
        for i, sub in enumerate(node):
            _check_keywords(sub, f"{path}/{i}")
        return
    if not isinstance(node, dict):
        return
    for key in _DROPPED_KEYWORDS:
        if key in node:
            raise ValueError(f"'{key}' (at {path}) is not supported by the grammar backend")
    if node.get("uniqueItems") is True:
        raise ValueError(f"'uniqueItems' (at {path}) is not supported by the grammar backend")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise ValueError(f"'allOf' with more than one schema (at {path}) is not supported by the grammar backend")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ValueError(f"'$ref' {ref!r} (at {path}): only references within the schema (#/...) are taken")
    bounded = [k for k in ("minLength", "maxLength") if k in node]
    shaped = [k for k in ("pattern", "format") if k in node]
    if bounded and shaped:
        raise ValueError(f"'{shaped[0]}' with '{bounded[0]}' (at {path}) is not supported by the grammar backend")
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list) and (isinstance(props, dict) or node.get("additionalProperties") is False):
        missing = [r for r in required if r not in (props or {})]
        if missing:
            raise ValueError(f"'required' names {missing[0]!r} (at {path}), which 'properties' does not define")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                _check_keywords(sub, f"{path}/{key}/{name}")
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if key in node:
            _check_keywords(node[key], f"{path}/{key}")


def _source(spec: StructuredOutputsParams) -> tuple[str, str]:
    """("regex", a regular expression) or ("ebnf", a grammar's text): what xgrammar parses for `spec`."""
    if spec.json is not None:
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        _check_depth(schema)
        _check_nesting(schema, "a pattern of the schema")
        _check_schema_keywords(schema)
        return "ebnf", json_grammar(schema, not spec.disable_any_whitespace)
    if spec.json_object:  # an object, as OpenAI's json_object mode (xgrammar's builtin takes any value)
        return "ebnf", json_grammar('{"type": "object"}', not spec.disable_any_whitespace)
    if spec.regex is not None:
        _check_nesting(spec.regex, "the regex")
        return "regex", spec.regex
    if spec.choice is not None:  # (non-ASCII as is: xgrammar reads \uXXXX surrogate pairs as two characters)
        return "ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    if spec.structural_tag is not None:
        return "ebnf", structural_tag_grammar(spec.structural_tag)
    _check_nesting(spec.grammar, "the grammar")
    if "::=" not in spec.grammar and _LARK_RULE.search(spec.grammar):
        return "ebnf", lark_grammar(spec.grammar)
    return "ebnf", spec.grammar


@functools.lru_cache(maxsize=64)
def structural_tag_grammar(text: str) -> str:
    """A structural tag (xgrammar's {"format": ...}, or vLLM's older structures and triggers) as EBNF text,
    after the checks every schema and pattern it holds gets; its JSON parts' whitespace runs are bounded as
    our JSON grammars' are, unless the tag sets its own bound."""
    import xgrammar

    _check_depth(text, 2 * MAX_SCHEMA_DEPTH)  # (the tag's own nesting; each schema in it gets the plain bound)
    _check_nesting(text, "a pattern of the structural tag")
    tag = json.loads(text)
    if tag.get("structures") is not None:  # vLLM's older form (read first, as vLLM does, where both are given):
        for i, item in enumerate(tag["structures"]):  # free text in which each trigger opens a structure
            _check_schema(item.get("schema", {}), f"#/structures/{i}/schema")
        fmt = {"type": "triggered_tags", "triggers": tag["triggers"], "tags": [
            {"type": "tag", "begin": item["begin"], "end": item["end"],
             "content": {"type": "json_schema", "json_schema": item.get("schema", {}),
                         "max_whitespace_cnt": MAX_JSON_WHITESPACE}} for item in tag["structures"]]}
    else:
        fmt = _bounded_schemas(tag["format"], "#/format")
    g = xgrammar.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))
    return str(g).replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)


def _check_schema(schema, path: str) -> None:
    _check_depth(json.dumps(schema))
    _check_keywords(schema, path)


def _bounded_schemas(node, path: str):
    """`node` (a structural tag's format) with the checks run on each schema it holds (a part carrying
    "json_schema", read as a leaf), and the JSON parts' whitespace bounded (a small model left free pads JSON
    with whitespace until max_tokens)."""
    if isinstance(node, list):
        return [_bounded_schemas(sub, f"{path}/{i}") for i, sub in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if "json_schema" in node:
        _check_schema(node["json_schema"], f"{path}/json_schema")
        return {"max_whitespace_cnt": MAX_JSON_WHITESPACE, **node} if node.get("type") == "json_schema" else node
    return {key: _bounded_schemas(sub, f"{path}/{key}") for key, sub in node.items()}


# a Lark rule's head ("start: ...", "?expr: ...", "NAME.2: ..."), where no line has EBNF's "::="
_LARK_RULE = re.compile(r"(?m)^\s*[?!]?[A-Za-z_]\w*(\.\d+)?\s*:")


@functools.lru_cache(maxsize=64)
def lark_grammar(text: str) -> str:
    """A Lark grammar (vLLM and OpenAI's tools take them) as xgrammar's EBNF text."""
    import xgrammar

    return str(xgrammar.Grammar.from_lark(text))


@functools.lru_cache(maxsize=64)
def _parse(kind: str, text: str) -> None:
    """xgrammar's parse of a grammar's text (raises for one it refuses; refusals are not cached)."""
    import xgrammar

    xgrammar.Grammar.from_regex(text) if kind == "regex" else xgrammar.Grammar.from_ebnf(text)


class GrammarError(ValueError):
    """A grammar tokenmill refuses (the server's 400 names the request field it came in)."""


@contextlib.contextmanager
def _refusing(spec: StructuredOutputsParams):
    try:
        yield
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse errors are RuntimeErrors
        raise GrammarError(f"invalid '{spec.kind}' for structured outputs: {_first_line(e)}") from None


def _check_tokens_concatenate(tok, info) -> None:
    """xgrammar matches text by concatenating its tokens' strings; a tokenizer whose decoding puts something
    between tokens (a word-level one, WordPiece's spaces) would get outputs that do not match. Refused."""
    text = "The quick brown fox, 12 jumps."
    ids = tok.encode(text, add_special_tokens=False)
    joined = b"".join(info.decoded_vocab[i] for i in ids if i < len(info.decoded_vocab)).decode(errors="replace")
    if joined.strip() != text.strip():
        raise ValueError("structured outputs need a tokenizer whose tokens' texts concatenate into the text (byte-"
                         f"level BPE, SentencePiece); this one's do not ({text!r} comes back as {joined!r})")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
