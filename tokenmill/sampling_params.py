"""Per-request sampling settings, named as in vLLM."""
from __future__ import annotations

import functools
import json as _json
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
JSON_KINDS = ("json", "json_object", "structural_tag")  # the kinds whose JSON a whitespace pattern would shape
STRUCTURED_FLAGS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


@dataclass
class StructuredOutputsParams:
    """What a request's output must match (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict
    or its JSON text), any JSON object, a regular expression, one of a list of strings, an EBNF grammar
    (xgrammar's dialect, GBNF-like; or Lark), or a structural tag (xgrammar's: free text in which each trigger
    opens a tagged part of its own schema, as tool calls; a dict or its JSON text). sample/grammar.py compiles
    it."""
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace but xgrammar's default separators
    # vLLM's, taken for its clients: there is one backend (nothing to fall back from), and a schema's objects
    # take no property it does not list unless its additionalProperties says so (xgrammar's strict mode)
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    # vLLM's too, but xgrammar has no whitespace regex: with JSON, a 400 that says so, rather than a pattern
    # ignored (with a regex, a choice or a grammar it would mean nothing, and is ignored, as in vLLM)
    whitespace_pattern: str | None = None
    # the grammar holds the output only after these tokens (a thinking model's "</think>": --reasoning-parser)
    start_after: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.start_after is None:
            self.start_after = ()
        if not isinstance(self.start_after, (list, tuple)) or any(type(t) is not int or not 0 <= t < 2**31
                                                                  for t in self.start_after):
            raise ValueError("invalid sampling parameter 'structured_outputs': 'start_after' must be a list of "
                             "token ids")
        self.start_after = tuple(self.start_after)
        for flag in ("json_object",) + STRUCTURED_FLAGS:  # (null, as clients send unset fields: false)
            if getattr(self, flag) is None:
                setattr(self, flag, False)
            elif type(getattr(self, flag)) is not bool:
                raise ValueError(f"invalid sampling parameter 'structured_outputs': '{flag}' must be true or false")
        set_ = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(set_) != 1:
            raise ValueError("invalid sampling parameter 'structured_outputs': set exactly one of "
                             f"{', '.join(STRUCTURED_KINDS)} (got {', '.join(set_) or 'none'})")
        ok = {"json": lambda v: isinstance(v, (str, dict)), "json_object": lambda v: v is True,
              "regex": lambda v: isinstance(v, str) and v, "grammar": lambda v: isinstance(v, str) and v,
              "choice": lambda v: isinstance(v, list) and v and all(isinstance(c, str) and c for c in v),
              "structural_tag": _is_structural_tag}
        if self.whitespace_pattern is not None and self.kind in JSON_KINDS:  # (elsewhere whitespace means nothing)
            raise ValueError("invalid sampling parameter 'structured_outputs': 'whitespace_pattern' is not supported "
                             "(the grammar backend has no whitespace regex); 'disable_any_whitespace': true allows "
                             "none but the separators")
        if not ok[self.kind](getattr(self, self.kind)):
            raise ValueError(f"invalid sampling parameter 'structured_outputs': '{self.kind}' must be "
                             + {"json": "a JSON schema (an object or its JSON text)", "json_object": "true",
                                "regex": "a non-empty string", "grammar": "a non-empty string",
                                "choice": "a non-empty list of non-empty strings",
                                "structural_tag": "an object (or its JSON text) with 'format', or with "
                                                  "'structures' and 'triggers'"}[self.kind])
        for key in ("json", "structural_tag"):  # kept as text: a deeply nested dict cannot be pickled to ranks
            if isinstance(getattr(self, key), dict):
                try:
                    setattr(self, key, _json.dumps(getattr(self, key)))
                except (TypeError, ValueError, RecursionError):
                    raise ValueError(f"invalid sampling parameter 'structured_outputs': '{key}' must be a JSON "
                                     "object or its JSON text") from None

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None and getattr(self, k) is not False)


def _not_int(value) -> bool:
    return not isinstance(value, int) or isinstance(value, bool)


def _is_structural_tag(value) -> bool:
    """A structural tag's shape, as vLLM and xgrammar take it: {"format": ...} (xgrammar's structural tag), or
    vLLM's older {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}; the text of either."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except (ValueError, RecursionError):
            return False
    if not isinstance(value, dict):
        return False
    if value.get("structures") is None:  # (vLLM reads "structures" first, where a tag has both)
        return isinstance(value.get("format"), dict)
    structures, triggers = value["structures"], value.get("triggers")
    return (isinstance(structures, list) and bool(structures) and isinstance(triggers, list) and bool(triggers)
            and all(isinstance(t, str) and t for t in triggers)
            and all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                    and isinstance(s.get("schema", {}), (dict, bool)) for s in structures))


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: sampled token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's, vLLM's)
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last N tokens (-1: max_model_len)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must match (sample/grammar.py)
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these ids
    bad_words: list[str] | None = None  # vLLM's: words (each one or more tokens) the output never contains
    detokenize: bool = True  # vLLM's: False leaves outputs as token ids (text ""); no stop strings then
    spaces_between_special_tokens: bool = True  # vLLM's; fast tokenizers (every shipped one) never add them
    extra_args: dict | None = None  # vLLM's: carried with the request for custom code, unread by the engine
    # Filled in by the engine from generation_config.json; not a user knob.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)
    # Filled in by the engine's tokenizer from bad_words: each word's token ids, as written and after a space
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"invalid sampling parameter '{field_name}': {why}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if _not_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if not _is_num(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not _is_num(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or not 1 <= self.max_tokens < 2**31):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if _not_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            raise bad("seed", f"must be a 64-bit integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (_not_int(v) or v < 0 or v > 20):  # (True was taken as 1, and failed the step)
                raise bad(name, f"must be an integer in [0, 20] (-1, vLLM's whole vocabulary, is not taken), "
                                f"got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(_not_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.truncate_prompt_tokens is not None and (type(self.truncate_prompt_tokens) is not int
                                                        or self.truncate_prompt_tokens < -1
                                                        or self.truncate_prompt_tokens == 0):
            raise bad("truncate_prompt_tokens", f"must be an integer >= 1, or -1 (max_model_len), got "
                                                f"{self.truncate_prompt_tokens!r}")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or any(type(t) is not int or t < 0 or not _is_num(b) for t, b in self.logit_bias.items())):
            raise bad("logit_bias", "must map non-negative token ids to finite numbers")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(type(t) is not int or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of non-empty strings")
        for flag in ("detokenize", "spaces_between_special_tokens"):
            if type(getattr(self, flag)) is not bool:
                raise bad(flag, f"must be true or false, got {getattr(self, flag)!r}")
        if not self.detokenize and self.stop:
            raise bad("stop", "stop strings need detokenize=True (as in vLLM)")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict")
        if isinstance(self.structured_outputs, dict):  # as vLLM's offline API also takes it
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                raise bad("structured_outputs", f"takes {', '.join(STRUCTURED_KINDS + STRUCTURED_FLAGS)}, "
                          f"got {', '.join(map(str, self.structured_outputs))}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @functools.cached_property
    def logit_bias_tensors(self) -> tuple:
        """(ids int64, biases float32) on the host, made once per request rather than per step (a bias over
        thousands of tokens rebuilt in Python every step would slow every request in the batch). A bias past
        +-1e4 acts as +-1e4: already certain either way, and past float range it would make NaNs."""
        import torch
        ids = list(self.logit_bias or {})
        biases = [min(max(float(b), -1e4), 1e4) for b in (self.logit_bias or {}).values()]
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(biases, dtype=torch.float32)

    @functools.cached_property
    def allowed_token_tensor(self):
        """allowed_token_ids as an int64 host tensor, made once per request."""
        import torch
        return torch.tensor(self.allowed_token_ids or [], dtype=torch.int64)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def argmax_only(self) -> bool:
        """Whether an argmax of the raw logits is the whole sampler (once min_tokens is reached): greedy,
        no logprobs, no penalties, no logit bias, no grammar, no allowed-token list, no bad words."""
        return (self.greedy and self.logprobs is None and not self.needs_penalties and not self.logit_bias
                and self.structured_outputs is None and self.allowed_token_ids is None
                and not (self.bad_words or self.bad_words_token_ids))

    @property
    def reads_output(self) -> bool:
        """Whether its sampler reads the output tokens: penalties count them; a bad word of several tokens
        is banned only after its first ones."""
        return self.needs_penalties or any(len(w) > 1 for w in self.bad_words_token_ids)

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end the request: stop_token_ids, and EOS unless ignore_eos."""
        return self.stop_token_ids + ([] if self.ignore_eos else list(self.eos_token_ids))

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _is_num(x) -> bool:
    """A finite real number (NaN and infinities are rejected)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
