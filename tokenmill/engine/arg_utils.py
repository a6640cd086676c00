"""Engine flags derived from `EngineConfig`'s fields (vLLM's `EngineArgs` idea): a field's name, type,
default, choices and help make its `--flag`, so an option is written once, in config.py, and every
command that builds an engine (generate, serve, bench offline, bench ladder, eval ppl) takes the same flags.

    EngineConfig.max_num_seqs: int = option(256, "most sequences in one step")
        -> --max-num-seqs N (type int, default 256, help "most sequences in one step (default: 256)")
    bool fields  -> --flag / --no-flag;   `str | None` -> type str, default None
    a field with a `const` -> `--flag` alone gives const (--quantize-lm-head is --quantize-lm-head int8)
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


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments a parsed command line holds."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}

