"""Engine flags come from EngineConfig's fields: every command that builds an engine takes every field, with
the field's default, and what it parses is what the engine gets."""
from dataclasses import fields

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.arg_utils import bare_flags_take_const, engine_kwargs
from tokenmill.entrypoints.cli import build_parser

COMMANDS = [["generate"], ["serve"], ["bench", "offline"], ["bench", "ladder"], ["eval", "ppl"]]


def _subparser(path):
    parser = build_parser()
    for name in path:
        parser = next(a for a in parser._actions if a.dest in ("command", "bench_command", "eval_command")
                      and name in a.choices).choices[name]
    return parser


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_config_field_is_a_flag(command):
    options = {o for a in _subparser(command)._actions for o in a.option_strings}
    missing = [f.name for f in fields(EngineConfig) if "--" + f.name.replace("_", "-") not in options]
    assert not missing, f"{' '.join(command)} lacks flags for {missing}"


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_parsed_defaults_are_the_config_defaults(command):
    args = build_parser().parse_args(command)
    overridden = {"eval": {"dtype"}, "bench ladder": {"dtype", "max_model_len", "max_num_seqs"}}
    skip = overridden.get(" ".join(command), overridden.get(command[0], set()))
    kwargs = engine_kwargs(args)
    assert set(kwargs) == {f.name for f in fields(EngineConfig)}
    for f in fields(EngineConfig):
        if f.name not in skip:
            assert kwargs[f.name] == f.default, f.name


def test_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "--max-num-seqs", "7", "--no-enable-prefix-caching", "-tp", "1",
                                      "--kv-cache-memory-gb", "0.5", "--scheduling-policy", "priority",
                                      "--static-batch-wait-s", "0.2", "--tokenizer", "tok"])
    kw = engine_kwargs(args)
    assert (kw["max_num_seqs"], kw["enable_prefix_caching"], kw["tensor_parallel_size"]) == (7, False, 1)
    assert (kw["kv_cache_memory_gb"], kw["scheduling_policy"], kw["static_batch_wait_s"]) == (0.5, "priority", 0.2)
    assert kw["tokenizer"] == "tok"


def test_choices_come_from_the_field(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-layout", "sparse"])
    assert "paged" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_layout must be one of paged, contiguous"):
        EngineConfig(kv_layout="sparse")


def test_help_comes_from_the_field():
    text = _subparser(["generate"]).format_help()
    assert "most sequences in one step (default: 256)" in " ".join(text.split())


def test_a_bare_optional_value_flag_before_the_prompt():
    """`--quantize-lm-head` takes an optional value: before a positional argument that is not one of its
    choices it means the flag alone, and the word stays the prompt."""
    def parse(*words):
        args = build_parser().parse_args(bare_flags_take_const(list(words)))
        return args.quantize_lm_head, args.prompt
    assert parse("generate", "--quantize-lm-head", "ROMEO:") == ("int8", ["ROMEO:"])
    assert parse("generate", "--quantize-lm-head", "int4", "ROMEO:") == ("int4", ["ROMEO:"])
    assert parse("generate", "ROMEO:", "--quantize-lm-head") == ("int8", ["ROMEO:"])
    assert parse("generate", "--quantize-lm-head", "--dtype", "float32", "ROMEO:") == ("int8", ["ROMEO:"])
    assert parse("generate", "ROMEO:") == (None, ["ROMEO:"])


@pytest.mark.parametrize("value, want", [("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("4096", 4096),
                                         ("auto", None), ("-1", None)])
def test_token_counts_take_vllms_suffixes(value, want):
    """--max-model-len and --max-num-batched-tokens as vLLM takes them (32k was 'invalid int value')."""
    args = build_parser().parse_args(["generate", "x", "--max-model-len", value, "--max-num-batched-tokens", value])
    assert engine_kwargs(args)["max_model_len"] == want and engine_kwargs(args)["max_num_batched_tokens"] == want


def test_a_token_count_that_is_not_one_is_a_clean_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--max-model-len", "2.5K"])
    assert "invalid token count '2.5K'" in capsys.readouterr().err
