"""Engine flags derived from `EngineConfig`'s fields (vLLM's `EngineArgs` idea): a field's name, type,
default, choices and help make its `--flag`, so an option is written once, in config.py, and every
command that builds an engine (generate, serve, bench offline, bench ladder, eval ppl) takes the same flags.

    EngineConfig.max_num_seqs: int = option(256, "most sequences in one step")
        -> --max-num-seqs N (type int, default 256, help "most sequences in one step (default: 256)")
    bool fields  -> --flag / --no-flag;   `str | None` -> type str, default None
    a field with a `const` -> `--flag` alone gives const (--quantize-lm-head is --quantize-lm-head int8),
                             also before a positional argument (`bare_flags_take_const`)
"""
from __future__ import annotations

import argparse
import types
import typing
from dataclasses import fields

from tokenmill.config import EngineConfig


def _scalar_type(annotation) -> type:
    """`int | None` -> int; `bool` -> bool."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = args
    return annotation


# token counts written as vLLM takes them: 32k = 32,000, 32K = 32,768, 25.6k = 25,600 (and `auto` / -1 for the
# model's own context length)
_HUMAN_INTS = ("max_model_len", "max_num_batched_tokens")
_UNITS = {"k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def human_int(text: str) -> int | None:
    """An integer, or a token count with vLLM's suffixes (decimal k/m/g, binary K/M/G); `auto` or -1: unset."""
    text = text.strip()
    if text in ("auto", "-1"):
        return None
    unit = _UNITS.get(text[-1:], 1)
    number = text[:-1] if unit != 1 else text
    try:
        value = float(number) * unit if unit != 1 and unit % 1000 == 0 and "." in number else int(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid token count {text!r} (an integer, or e.g. 32k, 32K)") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"invalid token count {text!r}: not a whole number of tokens")
    return int(value)


def add_engine_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """One flag per EngineConfig field. `defaults` overrides a field's default for this command only
    (eval ppl scores in float32, the ladder runs a small engine)."""
    hints = typing.get_type_hints(EngineConfig)
    group = parser.add_argument_group("engine options (the same for every command that builds an engine)")
    for f in fields(EngineConfig):
        kind = _scalar_type(hints[f.name])
        default = defaults.get(f.name, f.default)
        shown = "" if default is None else f" (default: {default})"
        kw: dict = dict(dest=f.name, default=default, help=f.metadata["help"] + shown)
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = human_int if f.name in _HUMAN_INTS else kind
            if f.metadata.get("choices"):
                kw["choices"] = [c for c in f.metadata["choices"] if c is not None]
            if f.metadata.get("const") is not None:  # `--flag` alone means const, `--flag V` means V
                kw["nargs"], kw["const"] = "?", f.metadata["const"]
        group.add_argument("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ()), **kw)


def bare_flags_take_const(argv: list[str]) -> list[str]:
    """argv with each optional-value flag's const written out where the word after it is not one of its
    choices: `generate --quantize-lm-head "ROMEO:"` means the flag alone and the prompt, where argparse would
    take the prompt for the flag's value and refuse it."""
    takes_const = {}
    for f in fields(EngineConfig):
        if f.metadata.get("const") is not None and f.metadata.get("choices"):
            for name in ("--" + f.name.replace("_", "-"), *f.metadata.get("aliases", ())):
                takes_const[name] = (f.metadata["const"], {str(c) for c in f.metadata["choices"] if c is not None})
    out = []
    for i, word in enumerate(argv):
        out.append(word)
        if word in takes_const:
            const, choices = takes_const[word]
            following = argv[i + 1] if i + 1 < len(argv) else None
            if following is not None and following not in choices and not following.startswith("-"):
                out.append(const)
    return out


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments a parsed command line holds."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}

