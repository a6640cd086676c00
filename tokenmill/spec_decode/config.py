"""`speculative_config`, in vLLM's shape:

    {"method": "ngram" | "draft_model", "model": PATH (draft_model), "num_speculative_tokens": k,
     "prompt_lookup_min": 2, "prompt_lookup_max": 5, "adaptive": true}

`num_speculative_tokens` is an upper bound when `adaptive` (the default): each step then picks k per
request from its measured acceptance and the measured cost of the step (spec_decode/adaptive.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

# drafts per step: more is never accepted in practice, and the per-depth bookkeeping grows with k
MAX_SPECULATIVE_TOKENS = 64
METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    adaptive: bool = True

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A dict, a JSON string (the CLI's --speculative-config) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.adaptive, bool):  # ("no" would read as true)
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}; got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1 and <= {MAX_SPECULATIVE_TOKENS}, "
                             f"got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a local model directory)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}
