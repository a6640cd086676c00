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
            kw["type"] = kind
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

