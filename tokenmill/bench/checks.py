"""Checks of a benchmark's settings that run before it does (a run must not end in an error it could have
given at once)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def check_writable(path: str | None, flag: str, directory: bool = False) -> None:
    """Refuse an output path before a run rather than after it (missing parent directories are created)."""
    if not path:
        return
    p = Path(path)
    try:
        (p if directory else p.parent).mkdir(parents=True, exist_ok=True)
        if directory:
            tempfile.TemporaryFile(dir=p).close()
        else:
            existed = p.exists()
            open(p, "a").close()  # "a": an existing file is left as it is
            if not existed:
                p.unlink()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_limit_mm(args) -> None:
    """--limit-mm-per-prompt checked up front (a ladder's rungs would each fail on it)."""
    from tokenmill.multimodal.processor import parse_limits

    parse_limits(getattr(args, "limit_mm_per_prompt", None))


def read_json(path, kind: type, not_json: str, wrong_kind: str):
    """A JSON file's value, which must be a `kind` (list or dict); else one line naming the file: `not_json`
    followed by the parser's error, or `wrong_kind` with {type} for what the file holds."""
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)
        except ValueError as e:  # bad JSON, or not UTF-8
            raise ValueError(f"{path}: {not_json} ({e})") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: " + wrong_kind.format(type=type(value).__name__))
    return value
