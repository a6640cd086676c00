"""Benchmark workloads: exact token-id prompt lengths, shared prefixes, ShareGPT parsing, long documents, the
long-text mix."""
import argparse
import json
import random

import pytest

from tokenmill.bench.datasets import (DATASETS, LONG_DOC_TEXT, LongDocumentDataset, PrefixRepetitionDataset,
                                      LongTextDataset, RandomDataset, ShareGPTDataset, add_dataset_args, dataset_from_args,
                                      get_tokenizer, sample_requests)
from tokenmill.config import DEFAULT_MODEL


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(DEFAULT_MODEL)


def test_random_exact_lengths(tok):
    reqs = sample_requests(RandomDataset(40, 7, 0.5), 20, tok, seed=3)
    special = set(tok.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 20 <= r.prompt_len <= 60 and 3 <= r.expected_output_len <= 10
        assert not special & set(r.prompt)
    assert len({r.request_id for r in reqs}) == 20
    again = sample_requests(RandomDataset(40, 7, 0.5), 20, tok, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    fixed = sample_requests(RandomDataset(16, 4), 3, tok)
    assert all(r.prompt_len == 16 and r.expected_output_len == 4 for r in fixed)
    with pytest.raises(ValueError):
        RandomDataset(16, 4, 1.0).sample(1, tok, random.Random(0))


def test_random_without_tokenizer():
    reqs = sample_requests(RandomDataset(12, 4), 2, None)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in reqs)


def test_prefix_repetition(tok):
    reqs = sample_requests(PrefixRepetitionDataset(prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5),
                           12, tok)
    assert all(len(r.prompt) == r.prompt_len == 40 for r in reqs)
    prefixes = {tuple(r.prompt[:32]) for r in reqs}
    assert len(prefixes) == 3
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 12  # suffixes differ


def test_sharegpt(tmp_path, tok):
    data = [
        {"conversations": [{"from": "human", "value": "Tell me of the king and his daughters, good sir."},
                           {"from": "gpt", "value": "The king divides his land among three daughters, and woe."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Too short a prompt."}]},
        {"conversations": [{"from": "human", "value": "Only one turn here, so it is skipped."}]},
        {"conversations": [{"from": "human", "value": "What light through yonder window breaks?"},
                           {"from": "gpt", "value": "It is the east, and Juliet is the sun."}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    reqs = sample_requests(ShareGPTDataset(str(path)), 2, tok)
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt, add_special_tokens=False)) >= 4
        assert r.expected_output_len >= 4
    assert {r.prompt[:4] for r in reqs} == {"Tell", "What"}
    assert all(r.expected_output_len == 9 for r in sample_requests(ShareGPTDataset(str(path), 9), 2, tok))
    with pytest.raises(ValueError, match="usable"):
        sample_requests(ShareGPTDataset(str(path)), 3, tok)


GOOD_TURNS = [{"from": "human", "value": "What light through yonder window breaks?"},
              {"from": "gpt", "value": "It is the east, and Juliet is the sun."}]


@pytest.mark.parametrize("bad", [
    "a string entry", 3, ["a", "list"], {"id": "no conversations"}, {"conversations": "not a list"},
    {"conversations": [1, 2]}, {"conversations": [{"from": "human"}, {"from": "gpt", "value": "no prompt value"}]},
    {"conversations": [{"value": ["not", "text"]}, {"value": "reply text here"}]},
])
def test_sharegpt_skips_malformed_entries_as_vllm_does(tmp_path, tok, bad):
    """Entries that are not {"conversations": [{"value": str}, {"value": str}, ...]} raised AttributeError,
    TypeError or KeyError; they are skipped (vLLM's choice) while a well-formed one is left, else refused."""
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([bad, {"conversations": GOOD_TURNS}]))
    reqs = sample_requests(ShareGPTDataset(str(path)), 1, tok)
    assert reqs[0].prompt == GOOD_TURNS[0]["value"]
    with pytest.raises(ValueError, match=r"only 1 usable conversations, 2 requested \(1 entries without two"):
        sample_requests(ShareGPTDataset(str(path)), 2, tok)
    path.write_text(json.dumps([bad, bad]))
    with pytest.raises(ValueError, match=f"{path}: no entry has the ShareGPT shape"):
        sample_requests(ShareGPTDataset(str(path)), 1, tok)


@pytest.mark.parametrize("text, message", [
    ("{bad", "not a ShareGPT JSON file"), ('{"conversations": []}', "is a JSON list of conversations, this is a dict"),
])
def test_sharegpt_file_that_is_not_a_list_is_refused_naming_it(tmp_path, text, message):
    """(The CLI prints a ValueError as one `error:` line.)"""
    path = tmp_path / "sg.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{path}: .*{message}"):
        sample_requests(ShareGPTDataset(str(path)), 1)


def test_long_document(tok):
    reqs = sample_requests(LongDocumentDataset(doc_len=8192, output_len=16), 2, tok)
    assert all(len(r.prompt) == r.prompt_len == 8192 for r in reqs)
    source = LONG_DOC_TEXT.read_text(encoding="utf-8")
    assert tok.decode(reqs[0].prompt[1:-1]) in source  # a real, contiguous slice of the document
    text = sample_requests(LongDocumentDataset(doc_len=100), 1, None)[0]
    assert isinstance(text.prompt, str) and len(text.prompt) == 400


def test_cli_args_build_each_dataset():
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    for name in DATASETS:
        args = p.parse_args(["--dataset-name", name, "--dataset-path", "x.json"])
        assert dataset_from_args(args).name == name
    args = p.parse_args(["--random-input-len", "7", "--output-len", "3"])
    ds = dataset_from_args(args)
    assert (ds.input_len, ds.output_len) == (7, 3)


def test_long_text_dataset_mixes_short_prompts_and_shared_documents():
    tok = get_tokenizer(DEFAULT_MODEL)
    ds = LongTextDataset(doc_len=300, short_len=20, question_len=10, questions_per_doc=3, long_fraction=0.5,
                         output_len=5)
    reqs = sample_requests(ds, 12, tok, seed=1)
    long = [r for r in reqs if r.length_class == "long"]
    short = [r for r in reqs if r.length_class == "short"]
    assert len(long) == 6 and len(short) == 6
    assert all(len(r.prompt) == r.prompt_len == 310 for r in long)
    assert all(len(r.prompt) == r.prompt_len == 20 for r in short)
    docs = {tuple(r.prompt[:300]) for r in long}
    assert len(docs) == 2  # 6 questions, 3 per document
    assert len({tuple(r.prompt[300:]) for r in long}) == 6  # every question differs
    assert [r.length_class for r in reqs] != ["long"] * 6 + ["short"] * 6  # arrivals interleave the classes
    assert sample_requests(ds, 12, tok, seed=1)[0].prompt == reqs[0].prompt  # seeded
    with pytest.raises(ValueError, match="long-fraction"):
        LongTextDataset(long_fraction=0)
