"""Structured outputs (sample/grammar.py): every output matches its grammar, whatever the engine does meanwhile
(batching with other requests, async scheduling, speculative decoding, preemption); a bad grammar is refused
when the request is made; the mask's torch unpacking agrees with xgrammar's own kernel."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import make_llm, random_prompts
import tokenmill
from tokenmill import SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams

xgrammar = pytest.importorskip("xgrammar")
SHIPPED = Path(tokenmill.__file__).parent / "assets" / "models" / "tiny-shakespeare"

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "lines", "alive"],
          "properties": {"name": {"enum": ["ROMEO", "JULIET", "TYBALT"]},
                         "lines": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                   "maxItems": 3},
                         "alive": {"type": "boolean"}}}
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=r"(ab|cd)[0-9]{2,4}-[xyz]"),
    "choice": StructuredOutputsParams(choice=["to be", "not to be", "the question"]),
    # bounded, so that a random model that would repeat "a," for ever must close it within max_tokens
    "grammar": StructuredOutputsParams(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c]{1,4}'),
}

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _matches(kind: str, text: str) -> bool:
    if kind == "json":
        v = json.loads(text)
        return (set(v) == {"name", "lines", "alive"} and v["name"] in ("ROMEO", "JULIET", "TYBALT")
                and isinstance(v["alive"], bool) and len(v["lines"]) <= 3 and all(0 <= x <= 9 for x in v["lines"]))
    if kind == "regex":
        return re.fullmatch(r"(ab|cd)[0-9]{2,4}-[xyz]", text) is not None
    if kind == "choice":
        return text in ("to be", "not to be", "the question")
    return re.fullmatch(r"\([a-c]{1,4}(,[a-c]{1,4}){0,3}\)", text) is not None


def _groups(n: int) -> str:
    return "(" * n + "a" + ")" * n


def _params(kind: str, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    return SamplingParams(max_tokens=60, structured_outputs=SPECS[kind], **kw)


def _generate(llm, prompts, params):
    """(the output tokens' own text, the tokens, finish reason) per prompt. Not the output's text: the
    detokenizer reads on from the prompt's last tokens, and a random prompt can end inside a UTF-8 character."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    tok = llm.get_tokenizer()
    return [(tok.decode(o.outputs[0].token_ids, skip_special_tokens=True), o.outputs[0].token_ids,
             o.outputs[0].finish_reason) for o in outs]


def _nested(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"k": schema}}
    return schema


# a sampled request among greedy ones, and plain requests beside them: their masks must not leak
MIXED = [_params("json"), _params("regex"), _params("choice", temperature=0.9, seed=3), _params("grammar"),
         SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
         _params("json", temperature=1.0, seed=7)]
PROMPTS = random_prompts([5, 17, 3, 30, 9, 12], seed=11)


@pytest.fixture(scope="module")
def reference(llama_dir):
    return _generate(make_llm(llama_dir), PROMPTS, MIXED)


def test_every_output_matches_its_grammar_and_ends_with_it(reference):
    kinds = ["json", "regex", "choice", "grammar", None, "json"]
    for kind, (text, _, reason) in zip(kinds, reference):
        if kind is None:
            continue
        assert _matches(kind, text), (kind, text)
        assert reason == "stop", (kind, text)  # the grammar completes, then only EOS is allowed


def test_a_request_alone_gets_the_tokens_it_gets_in_a_batch(llama_dir, reference):
    llm = make_llm(llama_dir)
    for i in (0, 1, 3):
        assert _generate(llm, [PROMPTS[i]], [MIXED[i]])[0] == reference[i]


@pytest.mark.parametrize("kw", [dict(async_scheduling=True, enforce_eager=True), dict(async_scheduling=True),
                                dict(speculative_config=NGRAM),
                                dict(num_kv_blocks=7, max_model_len=96, max_num_seqs=6),
                                dict(max_num_batched_tokens=8)],
                         ids=["async-eager", "async", "ngram", "preemption", "chunked"])
def test_engine_variants_give_the_plain_engine_tokens(llama_dir, reference, kw):
    llm = make_llm(llama_dir, **kw)
    got = _generate(llm, PROMPTS, MIXED)
    assert got == reference
    core = llm.llm_engine.core
    if kw.get("async_scheduling"):
        assert core.scheduler.num_run_ahead > 0
    if "num_kv_blocks" in kw:
        assert core.scheduler.num_preemptions > 0


def test_drafts_for_structured_requests_are_accepted_and_change_no_token():
    """With n-gram drafts from a prompt that holds text the grammars accept, structured requests take drafts
    (cut where the grammar refuses one), verify them against one mask per row, and give the plain engine's
    tokens, greedy and seeded."""
    text = ('{"name":"ROMEO","lines":[1,2],"alive":true} {"name":"JULIET","lines":[],"alive":false} '
            "(ab,ca) (a,bb,c) ")
    sps = [SamplingParams(temperature=t, seed=5, max_tokens=60, structured_outputs=SPECS[kind])
           for kind in ("json", "grammar") for t in (0.0, 0.8)]
    outs = []
    for kw in ({}, dict(speculative_config=NGRAM)):
        llm = make_llm(str(SHIPPED), dtype="auto", **kw)
        prompt = llm.get_tokenizer().encode(text)
        outs.append(_generate(llm, [prompt] * len(sps), sps))
    assert outs[1] == outs[0]
    for (text, _, reason), kind in zip(outs[0], ("json", "json", "grammar", "grammar")):
        assert reason == "length" or _matches(kind, text), (kind, text)
    stats = llm.llm_engine.core.scheduler.spec.stats
    assert stats.num_accepted_tokens >= 10 and stats.num_draft_tokens > stats.num_accepted_tokens, stats


def test_draft_masks_are_the_masks_of_stepping_token_by_token(llama_dir):
    """RequestGrammar.draft_bitmasks' row j is the mask after drafts[:j]; valid_drafts cuts at the first refused
    draft; neither moves the matcher (the next plain mask is the same as before)."""
    from tokenmill.sample.grammar import GrammarCompiler

    tok = make_llm(llama_dir).get_tokenizer()
    compiler = GrammarCompiler(tok, 512)
    spec = SPECS["grammar"]
    ids = tok.encode("(ab,ca,b)", add_special_tokens=False)
    stop = [tok.eos_token_id]
    for cut in range(len(ids)):
        seen, drafts = ids[:cut], ids[cut:] + [stop[0]]
        ref = compiler.matcher(spec, stop)
        want = [ref.next_bitmask(seen + drafts[:j]).clone() for j in range(len(drafts))]
        g = compiler.matcher(spec, stop)
        before = g.next_bitmask(seen).clone()
        rows = g.draft_bitmasks(seen, drafts)
        assert len(rows) == len(drafts) + 1 and rows[-1] == (None, False)  # past the stop token: unconstrained
        assert all(torch.equal(m, w) for (m, _), w in zip(rows, want))
        assert [done for _, done in rows[:-1]] == [False] * (len(drafts) - 1) + [True]
        assert g.valid_drafts(seen, drafts) == drafts
        bad = drafts[:1] + [tok.encode("z", add_special_tokens=False)[0]] + drafts[1:]
        assert g.valid_drafts(seen, bad) == drafts[:1]
        rows = g.draft_bitmasks(seen, bad)
        assert torch.equal(rows[1][0], want[1]) and all(m is None for m, _ in rows[2:])
        assert torch.equal(g.next_bitmask(seen), before)


def test_the_shipped_model_answers_in_json():
    llm = make_llm(str(SHIPPED), dtype="auto")
    sp = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SPECS["json"])
    (text, _, reason), = _generate(llm, [llm.get_tokenizer().encode("ROMEO:")], sp)
    assert _matches("json", text) and reason == "stop", text


def test_a_complete_grammar_ends_the_request_before_min_tokens(llama_dir):
    """Banning the stop tokens would leave nothing to sample: the grammar wins, and the output still matches."""
    llm = make_llm(llama_dir)
    sps = [_params("choice", min_tokens=30), _params("regex", min_tokens=30, temperature=1.0, seed=2)]
    for kind, (text, ids, reason) in zip(["choice", "regex"], _generate(llm, PROMPTS[:2], sps)):
        assert _matches(kind, text) and reason == "stop" and len(ids) < 30, (kind, text)


@pytest.mark.parametrize("spec, message", [
    (dict(json='{"type": "object", "properties": '), "invalid 'json'"),
    (dict(regex="(unclosed"), "invalid 'regex'"),
    (dict(grammar="root ::= undefined_rule"), "invalid 'grammar'"),
    (dict(json=_nested(40)), "brackets deep"),  # xgrammar would take seconds to minutes over a deep schema
    # groups nested deep: xgrammar overflowed its stack in the tens of thousands (a segfault took the server down)
    (dict(regex=_groups(300)), "the regex nests 300 groups deep"),
    (dict(json={"type": "string", "pattern": _groups(300)}), "a pattern of the schema nests 300 groups deep"),
    (dict(grammar=f'root ::= Regex("{_groups(300)}")'), "the grammar nests 301 groups deep"),
    # keywords xgrammar drops without a word: outputs that finished "stop" broke them
    (dict(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}), "'uniqueItems'"),
    (dict(json={"type": "array", "contains": {"const": 7}}), "'contains'"),
    (dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "'not' .at #/properties/a"),
    (dict(json={"if": {"type": "integer"}, "then": {"minimum": 3}}), "'if'"),
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), "'allOf' with more than one"),
    (dict(json={"$ref": "http://example.com/int.json"}), "only references within the schema"),
    (dict(json={"type": "string", "pattern": "[a-z]+", "maxLength": 3}), "'pattern' with 'maxLength'"),
    (dict(json={"type": "object", "properties": {"a": {}}, "required": ["b"]}), "'required' names 'b'"),
])
def test_a_grammar_that_does_not_compile_is_refused_and_the_engine_serves_on(llama_dir, spec, message):
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)),
                     use_tqdm=False)
    assert _generate(llm, [PROMPTS[1]], [MIXED[1]])[0][2] == "stop"


def test_lark_grammars_are_taken_as_vllm_takes_them(llama_dir):
    """A grammar with no "::=" that defines Lark rules ("start: ...") is Lark (they were a 400: xgrammar's EBNF
    parser refused the lexer syntax); xgrammar turns it into EBNF. A bad one is the same 400 as a bad EBNF."""
    lark = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: /[a-c]{1,4}/\n'
    llm = make_llm(llama_dir)
    for t in (0.0, 1.0):
        sp = SamplingParams(temperature=t, seed=4, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(grammar=lark))
        (text, _, reason), = _generate(llm, [PROMPTS[0]], sp)
        assert reason == "stop" and re.fullmatch(r"(hello|hi) [a-c]{1,4}", text), text
    with pytest.raises(ValueError, match="invalid 'grammar'"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs=StructuredOutputsParams(
            grammar="start: undefined_rule\n")), use_tqdm=False)


def test_schemas_whose_keywords_the_backend_keeps_are_taken(llama_dir):
    """The keyword check reads keywords where schemas are, not property names ("not", "if" as names), and lets
    pydantic's one-schema allOf and local $refs through."""
    schema = {"type": "object", "properties": {"not": {"type": "boolean"}, "if": {"allOf": [{"$ref": "#/$defs/n"}]}},
              "required": ["not", "if"], "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "additionalProperties": False}
    llm = make_llm(llama_dir)
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True))
    (text, _, reason), = _generate(llm, [PROMPTS[0]], sp)
    assert reason == "length" or set(json.loads(text)) == {"not", "if"}, text


# vLLM's older structural tag: free text, in which every "e" opens a tag whose content is a digit
DIGIT_TAGS = {"structures": [{"begin": "e<", "schema": {"type": "integer", "minimum": 0, "maximum": 9}, "end": ">"}],
              "triggers": ["e"]}


def test_structural_tags_hold_each_tag_a_trigger_opens(llama_dir):
    """vLLM's structural tags (xgrammar's): the text is free until a trigger, which opens its tag; the tag's
    content matches its schema and its end closes it. Both forms, sampled (a random model writes the trigger
    often), and xgrammar's `format` form with a tag that must open the text."""
    llm = make_llm(llama_dir)
    outs = _generate(llm, PROMPTS[:4], [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=
                                                       StructuredOutputsParams(structural_tag=DIGIT_TAGS))
                                        for s in range(4)])
    texts = [t for t, _, _ in outs]
    assert all(re.fullmatch(r"([^e]|e<[0-9]>)*(e<[0-9]?)?", t, re.S) for t in texts), texts  # (max_tokens may cut)
    assert sum(t.count("e<") for t in texts) >= 3, texts  # the tags were exercised, not just avoided
    call = {"format": {"type": "tag", "begin": "<call>", "end": "</call>",
                       "content": {"type": "regex", "pattern": r"(ab|cd)[0-9]{2,4}-[xyz]"}}}
    for t in (0.0, 1.0):
        sp = SamplingParams(temperature=t, seed=2, max_tokens=40, structured_outputs={"structural_tag": call})
        (text, _, reason), = _generate(llm, [PROMPTS[1]], sp)
        assert reason == "stop" and re.fullmatch(r"<call>(ab|cd)[0-9]{2,4}-[xyz]</call>", text), text


@pytest.mark.parametrize("tag, message", [
    ({"structures": [{"begin": "<tool>", "schema": {}, "end": "</tool>"}], "triggers": ["<fn"]}, "does not match"),
    ({"format": {"type": "bogus"}}, "not recognized"),
    ({"format": {"type": "tag", "begin": "<a>", "end": "</a>", "content": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"x": {"not": {}}}}}}}, "'not' .at #/format/content/json_schema/properties/x"),
    ({"structures": [{"begin": "e<", "schema": {"type": "array", "uniqueItems": True}, "end": ">"}], "triggers": ["e"]},
     "'uniqueItems' .at #/structures/0/schema"),
    ({"format": {"type": "regex", "pattern": _groups(300)}}, "a pattern of the structural tag nests 300"),
])
def test_a_structural_tag_the_backend_refuses_is_refused(llama_dir, tag, message):
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs={"structural_tag": tag}),
                     use_tqdm=False)
    assert _generate(llm, [PROMPTS[1]], [MIXED[1]])[0][2] == "stop"


def test_vllms_backend_flags_are_taken_and_a_whitespace_pattern_is_refused():
    """disable_fallback and disable_additional_properties are what tokenmill's one backend does anyway (an object
    takes only the properties its schema lists); whitespace_pattern cannot be honoured, so with JSON it is a clear
    error (with a regex it means nothing, and is ignored, as in vLLM)."""
    spec = StructuredOutputsParams(json=SCHEMA, disable_fallback=True, disable_additional_properties=True)
    assert spec.kind == "json" and spec.disable_fallback and spec.disable_additional_properties
    for kind in (dict(json=SCHEMA), dict(json_object=True), dict(structural_tag=DIGIT_TAGS)):
        with pytest.raises(ValueError, match="'whitespace_pattern' is not supported"):
            StructuredOutputsParams(**kind, whitespace_pattern=r"[\n ]*")
    assert StructuredOutputsParams(regex="a+", whitespace_pattern=" *").kind == "regex"
    with pytest.raises(ValueError, match="'disable_fallback' must be true or false"):
        StructuredOutputsParams(json=SCHEMA, disable_fallback="yes")


def _tag_accepts(tag: dict, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    from tokenmill.sample.grammar import structural_tag_grammar

    return _is_grammar_accept_string(structural_tag_grammar(json.dumps(tag)), text)


def test_structural_tags_read_as_vllm_reads_them():
    """structures before format where a tag has both (vLLM's order); JSON whitespace inside tags bounded as in our
    JSON grammars (a small model padded a tag's JSON with whitespace until max_tokens) unless the tag sets its
    own; a schema inside a tag gets the depth bound a schema alone gets; a part that carries a schema is read as
    one, not walked as a format (qwen_xml_parameter's schema kept as given, its keywords checked)."""
    both = {**DIGIT_TAGS, "format": {"type": "const_string", "value": "FMT"}}
    assert _tag_accepts(both, "xa e<7>") and not _tag_accepts(both, "FMT e")  # (the format alone: "FMT" only)
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    call = {"format": {"type": "tag", "begin": "<c>", "end": "</c>", "content": {"type": "json_schema",
                                                                             "json_schema": obj}}}
    padded = "<c>{" + " " * 30 + '"a": 1}</c>'
    assert _tag_accepts(call, "<c>{" + " " * 24 + '"a": 1}</c>') and not _tag_accepts(call, padded)
    call["format"]["content"]["max_whitespace_cnt"] = 40
    assert _tag_accepts(call, padded)
    legacy = {"structures": [{"begin": "<c>", "end": "</c>", "schema": obj}], "triggers": ["<c"]}
    assert _tag_accepts(legacy, 'x<c>{"a": 1}</c>y') and not _tag_accepts(legacy, "x" + padded)
    deep = {"type": "integer"}
    for _ in range(60):
        deep = {"type": "array", "items": deep}
    assert _tag_accepts({"format": {"type": "triggered_tags", "triggers": ["<c"], "tags": [
        {"type": "tag", "begin": "<c>", "end": "</c>", "content": {"type": "json_schema", "json_schema": deep}}]}},
        "x")
    xml = {"format": {"type": "qwen_xml_parameter", "json_schema": {
        "type": "object", "properties": {"a": {"const": {"type": "json_schema"}}}, "required": ["a"]}}}
    from tokenmill.sample.grammar import structural_tag_grammar
    assert "max_whitespace_cnt" not in structural_tag_grammar(json.dumps(xml))
    xml["format"]["json_schema"]["properties"]["a"] = {"not": {}}
    with pytest.raises(ValueError, match="'not' .at #/format/json_schema/properties/a"):
        structural_tag_grammar(json.dumps(xml))


@pytest.mark.parametrize("spec", [{}, dict(json={}, regex="a"), dict(choice=[]), dict(choice=["a", 1]),
                                  dict(regex=""), dict(json_object=False), dict(structural_tag={}),
                                  dict(structural_tag="{"), dict(structural_tag={"structures": [], "triggers": ["a"]}),
                                  dict(structural_tag={"structures": [{"begin": "a"}], "triggers": ["a"]}),
                                  dict(structural_tag={"format": "tag"})])
def test_params_need_exactly_one_well_formed_grammar(spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={**spec, "jsn": {}})  # as a dict, unknown keys too


def test_torch_unpacking_of_the_mask_matches_xgrammars_kernel():
    from tokenmill.sample.grammar import apply_token_masks

    g = torch.Generator().manual_seed(0)
    vocab, rows = 1000, [0, 2, 3]  # a width that is not a multiple of 32; row 1 unmasked
    logits = torch.randn(4, vocab, generator=g)
    masks = [torch.randint(-2**31, 2**31 - 1, (32,), generator=g, dtype=torch.int64).to(torch.int32) for _ in rows]
    ours = logits.clone()
    apply_token_masks(ours, rows, masks)
    theirs = logits.clone()
    full = torch.full((4, 32), -1, dtype=torch.int32)  # xgrammar indexes the bitmask by the logits' row
    full[rows] = torch.stack(masks)
    xgrammar.apply_token_bitmask_inplace(theirs, full, indices=rows)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[1], logits[1]) and torch.isinf(ours[0]).any()


def test_choices_and_json_strings_hold_any_text_and_never_raw_control_characters(llama_dir):
    """Non-ASCII choices (an emoji is a surrogate pair in JSON's \\u escapes, which xgrammar would read as two
    characters) come out whole; a length-bounded JSON string refuses the raw control characters xgrammar's own
    grammar lets through (JSON forbids them)."""
    llm = make_llm(llama_dir)
    emoji = StructuredOutputsParams(choice=["🙂", "a🙂b", "café"])
    for seed in range(4):
        (text, _, reason), = _generate(llm, [PROMPTS[seed]], [SamplingParams(temperature=1.0, seed=seed,
                                                                            max_tokens=20, structured_outputs=emoji)])
        assert text in emoji.choice and reason == "stop"
    from tokenmill.sample.grammar import GrammarCompiler
    compiler = GrammarCompiler(llm.get_tokenizer(), 512)
    bounded = compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 6}}}, disable_any_whitespace=True))
    for text, ok in (('{"a": "ab"}', True), ('{"a": "a\x00"}', False), ('{"a": "a\x1f"}', False),
                     ('{"a": "a\tb"}', False)):
        assert xgrammar.GrammarMatcher(bounded).accept_string(text) is ok, text


def test_stop_ids_outside_the_vocabulary_do_not_fail_the_step(llama_dir):
    """An id past the vocabulary can never be sampled: the matcher leaves it out (xgrammar refuses it, which
    failed every request in the step)."""
    llm = make_llm(llama_dir)
    sp = [_params("regex", stop_token_ids=[10**6]), SamplingParams(temperature=0, max_tokens=5)]
    (text, _, reason), plain = _generate(llm, PROMPTS[:2], sp)
    assert _matches("regex", text) and reason == "stop" and plain[2] == "length"


def test_a_slow_grammar_compiles_off_the_engines_steps(llama_dir, monkeypatch):
    """While a grammar compiles (on a thread) its request waits outside the scheduler; the other requests keep
    stepping, and it joins once compiled. An abort while it waits drops it, and its compile, queued behind
    the slow one, never runs."""
    import threading

    from tokenmill.engine import grammar_wait

    monkeypatch.setattr(grammar_wait, "compile_threads", lambda: 1)  # "gone" queues behind the slow compile
    llm = make_llm(llama_dir)
    engine = llm.llm_engine
    gate, compiler = threading.Event(), engine.core.runner.grammars  # the engine's (the front end has its own)
    real, compiles = compiler.compile, []

    def slow(spec):
        if threading.current_thread().name.startswith("tokenmill-grammar"):  # GrammarWait's (not the matcher's)
            compiles.append(spec)
            gate.wait(30)
        return real(spec)
    monkeypatch.setattr(compiler, "compile", slow)
    engine.add_request("plain", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("regex", {"prompt_token_ids": PROMPTS[1]}, MIXED[1])
    engine.add_request("gone", {"prompt_token_ids": PROMPTS[2]}, MIXED[1])
    finished = []
    while "plain" not in finished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert set(engine.core.grammar_wait.waiting) == {"regex", "gone"}  # the plain request ran meanwhile
    engine.abort_request(["gone"])
    gate.set()
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert set(outs) == {"regex"} and len(compiles) == 1
    assert _matches("regex", llm.get_tokenizer().decode(outs["regex"].outputs[0].token_ids, skip_special_tokens=True))
    engine.check_invariants()


def test_a_slow_compile_holds_up_no_other_grammar(llama_dir, monkeypatch):
    """Grammars compile on two threads (at least): a request whose grammar takes long, aborted meanwhile (a
    running compile cannot be stopped), no longer holds up the next structured request (one thread: it waited
    the whole compile out, 6 s in a review's run)."""
    import threading

    from tokenmill.engine import grammar_wait

    monkeypatch.setattr(grammar_wait, "compile_threads", lambda: 2)
    llm = make_llm(llama_dir)
    engine = llm.llm_engine
    gate, compiler = threading.Event(), engine.core.runner.grammars
    real = compiler.compile

    def slow(spec):
        if spec is SPECS["regex"] and threading.current_thread().name.startswith("tokenmill-grammar"):
            gate.wait(30)
        return real(spec)
    monkeypatch.setattr(compiler, "compile", slow)
    engine.add_request("slow", {"prompt_token_ids": PROMPTS[1]}, _params("regex"))
    engine.add_request("fast", {"prompt_token_ids": PROMPTS[2]}, _params("choice"))
    finished = []
    for _ in range(2000):
        finished += [o.request_id for o in engine.step() if o.finished]
        if "fast" in finished:
            break
    assert finished == ["fast"] and not gate.is_set()
    engine.abort_request(["slow"])
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()


def test_a_tokenizer_whose_tokens_do_not_concatenate_is_refused():
    """xgrammar matches text by concatenating tokens' strings; the shipped LLaVA's word-level tokenizer puts
    spaces between words, so a grammar's output would not match it."""
    from tokenmill.engine.input_processor import load_tokenizer
    from tokenmill.sample.grammar import GrammarCompiler

    tok = load_tokenizer(str(SHIPPED.parent / "tiny-llava"))
    with pytest.raises(ValueError, match="concatenate"):
        GrammarCompiler(tok, len(tok)).compile(SPECS["choice"])


def test_a_grammar_that_fails_in_the_engine_ends_only_its_request(llama_dir, monkeypatch):
    """The front end compiled it, so this should not happen; if the engine's compile fails anyway, that request
    ends (aborted) and the others run on (in the step, the error would fail every request there)."""
    llm = make_llm(llama_dir)
    engine = llm.llm_engine

    def broken(spec):
        raise MemoryError("out of memory compiling")
    monkeypatch.setattr(engine.core.runner.grammars, "compile", broken)
    engine.add_request("plain", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=6))
    engine.add_request("regex", {"prompt_token_ids": PROMPTS[1]}, MIXED[1])
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outs["regex"].outputs[0].finish_reason == "abort" and not outs["regex"].outputs[0].token_ids
    assert len(outs["plain"].outputs[0].token_ids) == 6
    engine.check_invariants()


def test_a_stop_token_that_is_text_stays_text_to_the_grammar():
    """'"' as a stop token id: the grammar's stops are EOS alone (vLLM's), so '"' stays text the grammar needs;
    sampled, it ends the request as a stop token, which stop_reason names. (It was one of the grammar's own
    stops: banned as text, the regex's output came back empty, the schema's as '{', both "stop" with no reason.)"""
    llm = make_llm(str(SHIPPED), dtype="auto")
    tok = llm.get_tokenizer()
    quote = tok.encode('"', add_special_tokens=False)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    for spec in (StructuredOutputsParams(regex='"[a-z]{2,5}"'),
                 StructuredOutputsParams(json=schema, disable_any_whitespace=True)):
        sp = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=quote, structured_outputs=spec)
        out = llm.generate([{"prompt_token_ids": tok.encode("ROMEO:")}], sp, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == quote[0] and out.token_ids[-1] == quote[0], out


def test_logprobs_with_a_grammar_are_over_the_tokens_it_allows():
    """As vLLM's (it masks the logits before its sampler): a "choice" request's top logprobs are among its
    choices' tokens (they were the raw logits' top tokens, which the grammar bans: a classifier read nonsense)."""
    import math

    llm = make_llm(str(SHIPPED), dtype="auto")
    sp = SamplingParams(temperature=0, max_tokens=5, logprobs=5,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate([{"prompt_token_ids": llm.get_tokenizer().encode("ROMEO:")}], sp, use_tqdm=False)[0]
    first = [lp for lp in out.outputs[0].logprobs[0].values() if lp.logprob > -math.inf]
    assert first and all("yes".startswith(lp.decoded_token) or "no".startswith(lp.decoded_token) for lp in first)
    assert math.isclose(sum(math.exp(lp.logprob) for lp in first), 1.0, rel_tol=1e-3) or len(first) == 5
    assert out.outputs[0].text in ("yes", "no") and math.isfinite(out.outputs[0].cumulative_logprob)


def test_a_grammar_its_own_stop_tokens_leave_nothing_to_start_ends_at_once():
    """"{" as a stop token: it is text to the grammar (its stops are EOS alone), so the object starts with it
    and the request stops there (before it was the grammar's stop: a JSON object could never start, the mask
    allowed nothing, and once the request sampled token 0 from an all -inf row and went on unconstrained)."""
    llm = make_llm(str(SHIPPED), dtype="auto")
    tok = llm.get_tokenizer()
    brace = tok.encode("{", add_special_tokens=False)
    for t in (0.0, 0.8):
        sp = SamplingParams(temperature=t, seed=1, max_tokens=12, stop_token_ids=brace,
                            structured_outputs=StructuredOutputsParams(json_object=True))
        (text, ids, reason), = _generate(llm, [tok.encode("ROMEO:")], sp)
        assert reason == "stop" and len(ids) == 1 and ids[0] in brace + [tok.eos_token_id], (t, ids, text)


def test_the_front_end_parses_a_grammar_and_only_the_engine_compiles_it(llama_dir, monkeypatch):
    """Compiling against the vocabulary is the costly part: the front end only parses to refuse a bad grammar,
    so a new schema is compiled once per request, in the engine, not twice."""
    from tokenmill.sample.grammar import GrammarCompiler

    llm = make_llm(llama_dir)
    front, engine = llm.llm_engine.input_processor.grammars, llm.llm_engine.core.runner.grammars
    compiled, real = [], GrammarCompiler.compile
    monkeypatch.setattr(GrammarCompiler, "compile", lambda self, spec: (compiled.append(self), real(self, spec))[1])
    (text, _, reason), = _generate(llm, PROMPTS[:1], [_params("regex")])
    assert _matches("regex", text) and reason == "stop"
    assert compiled and all(c is engine for c in compiled) and front is not engine
    with pytest.raises(ValueError, match="invalid 'regex'"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(structured_outputs={"regex": "(ab"}),
                     use_tqdm=False)


def test_a_grammar_that_starts_after_a_thinking_models_end_tag(llama_dir):
    """start_after: the output is free until it has those tokens (a thinking model's "</think>"), then held. Here
    the tag is the first two tokens the model writes anyway: they come out as without a grammar, the rest
    matches the regex, and async scheduling and n-gram drafts (which may run across the tag) give the same."""
    plain = _generate(make_llm(llama_dir), PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=8)])[0][1]
    tag = tuple(plain[:2])
    sp = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(
              regex=r"(ab|cd)[0-9]{2,4}-[xyz]", start_after=tag)),
          SamplingParams(temperature=0.9, seed=4, max_tokens=40, structured_outputs=StructuredOutputsParams(
              choice=["to be", "not to be"], start_after=tag))]
    runs = [_generate(make_llm(llama_dir, **kw), PROMPTS[:1] * 2, sp)
            for kw in ({}, dict(async_scheduling=True), dict(speculative_config=NGRAM))]
    assert runs[0] == runs[1] == runs[2]
    tok = make_llm(llama_dir).get_tokenizer()
    (_, ids, reason), (_, seeded_ids, seeded_reason) = runs[0]
    assert tuple(ids[:2]) == tag and reason == "stop"
    assert _matches("regex", tok.decode(ids[2:], skip_special_tokens=True))
    if tuple(seeded_ids[:2]) == tag:  # (the seeded request may write the tag later, or never)
        assert tok.decode(seeded_ids[2:], skip_special_tokens=True) in ("to be", "not to be")
    with pytest.raises(ValueError, match="start_after"):
        StructuredOutputsParams(regex="a", start_after=[-1])


def test_draft_masks_across_the_start_of_a_grammar(llama_dir):
    """A verification whose drafts complete the start_after tag: rows before it free, the row after it the
    grammar's first mask; drafts are cut only past the tag, where the grammar refuses one."""
    from tokenmill.sample.grammar import GrammarCompiler

    tok = make_llm(llama_dir).get_tokenizer()
    compiler = GrammarCompiler(tok, 512)
    tag = tuple(tok.encode("</think>", add_special_tokens=False))
    answer = tok.encode("(ab,c)", add_special_tokens=False)
    spec = StructuredOutputsParams(grammar=SPECS["grammar"].grammar, start_after=tag)
    stop = [tok.eos_token_id]
    first = compiler.matcher(StructuredOutputsParams(grammar=SPECS["grammar"].grammar), stop).next_bitmask([]).clone()
    free = tok.encode("so it is", add_special_tokens=False)
    for split in range(len(tag)):  # the tag partly in the output, the rest in the drafts
        g = compiler.matcher(spec, stop)
        out, drafts = free + list(tag[:split]), list(tag[split:]) + answer
        assert g.next_bitmask(out) is None and g.waiting
        rows = g.draft_bitmasks(out, drafts)
        at = len(tag) - split  # the row right after the tag
        assert all(m is None for m, _ in rows[:at]) and torch.equal(rows[at][0], first)
        assert all(m is not None for m, _ in rows[at:])
        assert g.valid_drafts(out, drafts) == drafts
        bad = list(tag[split:]) + tok.encode("z", add_special_tokens=False)
        assert g.valid_drafts(out, bad) == list(tag[split:])
        assert g.waiting and g.next_bitmask(out + list(tag[split:])) is not None and not g.waiting


@pytest.mark.parametrize("how", ["compile fails", "aborted while compiling"])
def test_n_siblings_go_on_when_the_first_ones_grammar_ends_in_the_engine(llama_dir, monkeypatch, how):
    """n > 1: the later children wait for the first child's prompt blocks while it is unfinished; a first child
    whose grammar fails in the engine (or which is aborted while it compiles) never runs, so it must count as
    finished, or its siblings waited forever (and the core spun)."""
    import threading

    llm = make_llm(llama_dir)
    engine = llm.llm_engine
    compiler, gate, calls = engine.core.runner.grammars, threading.Event(), []
    real = compiler.compile

    def first_fails(spec):
        if threading.current_thread().name.startswith("tokenmill-grammar"):
            calls.append(spec)
            if len(calls) == 1:
                if how == "compile fails":
                    raise RuntimeError("transient compile failure")
                gate.wait(30)
        return real(spec)
    monkeypatch.setattr(compiler, "compile", first_fails)
    params = replace(MIXED[1], n=2, max_tokens=8)
    engine.add_request("p", {"prompt_token_ids": PROMPTS[1]}, params)
    if how != "compile fails":  # (the core's own abort of one child: the front end would wait for its output)
        engine.core.abort(["p#0"])
        gate.set()
        for _ in range(200):
            engine.step()
            if not engine.core.scheduler.requests and not engine.core.grammar_wait.waiting:
                break
        assert not engine.core.scheduler.requests  # the second child ran to its end
        return
    outs = []
    for _ in range(200):
        outs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    last = outs[-1]
    assert last.finished and sorted(c.index for c in last.outputs) == [0, 1]
    done = {c.index: c for c in last.outputs}
    assert done[0].finish_reason == "abort" and done[1].finish_reason in ("stop", "length")
    assert _matches("regex", llm.get_tokenizer().decode(done[1].token_ids, skip_special_tokens=True)) \
        or done[1].finish_reason == "length"
    engine.check_invariants()
