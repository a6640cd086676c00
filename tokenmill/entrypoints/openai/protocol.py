"""OpenAI request/response schemas (pydantic). Bounds live here so bad values are rejected with a 400
naming the field before anything reaches the engine. Extra, vLLM-style sampling fields are accepted
next to OpenAI's (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, priority, ...).

Requests are validated strictly (`true` is a boolean, `"yes"` and `0` are not; `"2"` is not an integer),
every string is checked once here for text that cannot be encoded (lone surrogates, which JSON's \\u
escapes can spell), and union-typed fields pick their branch from the input's shape, so an error names the
real problem (`prompt[0]` is negative) instead of the first branch that failed (`prompt.str`).
Fields a request sends that no schema here knows are ignored, as OpenAI and vLLM do, and logged once per
name (as vLLM warns), so that a client relying on one we lack finds out."""
from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

logger = logging.getLogger("tokenmill")
_IGNORED_LOGGED: set[tuple[str, str]] = set()  # (request kind, field) already logged, at most _IGNORED_CAP
_IGNORED_CAP = 1000

# Finite numbers only: JSON parsers accept NaN/Infinity, which would poison the sampler.
Float = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # int64, as vLLM; generators take it mod 2**64


def _first_unencodable(value) -> str | None:
    """Where `value` (a string, or lists and dicts of them) holds text UTF-8 cannot encode, or None.
    Lists are homogeneous once validated, so a list whose first item is not text (token ids) is skipped."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"U+{ord(value[e.start]):04X} at position {e.start}"
        return None
    if isinstance(value, list) and value and isinstance(value[0], (str, list, dict)):
        for i, item in enumerate(value):
            if (where := _first_unencodable(item)) is not None:
                return f"{where} of item {i}"
    elif isinstance(value, dict):
        for k, v in value.items():
            if (where := _first_unencodable(k) or _first_unencodable(v)) is not None:
                return where
    return None


def _allows_none(annotation) -> bool:
    return annotation is None or type(None) in get_args(annotation)


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # OpenAI's schema makes most fields nullable and clients send `"stream": null`, `"n": null`: a field
        # that cannot hold None takes its default for an explicit null (as vLLM's Optional fields do)
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if v is not None or k not in fields or _allows_none(fields[k].annotation)
                    or fields[k].is_required()}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _encodable_text(cls, value):
        # nested models ran this validator on their own fields already; strings and containers remain
        if isinstance(value, (str, list, dict)) and (where := _first_unencodable(value)) is not None:
            raise PydanticCustomError("unicode_text", "text is not valid Unicode (lone surrogate {where})",
                                      {"where": where})
        return value


def _shape(value) -> str | None:
    """The union branch a value's shape selects (None: no branch fits)."""
    if isinstance(value, str):
        return "<text>"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "<texts>" if isinstance(first, str) else "<id_lists>" if isinstance(first, list) else "<ids>"


# branch tags show in error locations (they cannot be field names); errors drop them: prompt[0], not prompt.<ids>[0]
UNION_TAGS = frozenset({"<text>", "<texts>", "<ids>", "<id_lists>", "<parts>", "<text-part>", "<image_url-part>",
                        "<video_url-part>"})

Prompt = Annotated[
    Union[Annotated[StrictStr, Tag("<text>")], Annotated[list[StrictStr], Tag("<texts>")],
          Annotated[list[TokenId], Tag("<ids>")], Annotated[list[list[TokenId]], Tag("<id_lists>")]],
    Discriminator(_shape, custom_error_type="prompt_type",
                  custom_error_message="must be a string, a list of strings, a list of token ids or a list of "
                                       "lists of token ids")]
Stop = Annotated[
    Union[Annotated[StrictStr, Tag("<text>")], Annotated[list[StrictStr], Field(max_length=1024), Tag("<texts>")]],
    Discriminator(lambda v: _shape(v) if _shape(v) in ("<text>", None) else "<texts>",
                  custom_error_type="stop_type", custom_error_message="must be a string or a list of strings")]


class StreamOptions(OpenAIBase):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIBase):
    name: StrictStr = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # (`schema` would shadow pydantic's)
    strict: bool | None = None


class ResponseFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's "structural_tag": xgrammar's `format`, or the older `structures` ({begin, schema, end}) + `triggers`
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[StrictStr] | None = None


class _SamplingFields(OpenAIBase):
    """Fields shared by completions and chat."""

    @model_validator(mode="before")
    @classmethod
    def _log_ignored_fields(cls, data):
        if isinstance(data, dict):
            known = cls.model_fields
            ignored = [k for k in data if k not in known and (cls.__name__, k) not in _IGNORED_LOGGED]
            # (a client sending random names cannot grow the set past its cap; names are logged escaped)
            ignored = ignored[:max(0, _IGNORED_CAP - len(_IGNORED_LOGGED))]
            if ignored:
                _IGNORED_LOGGED.update((cls.__name__, k) for k in ignored)
                logger.warning("%s: fields that tokenmill does not support were ignored: %s (logged once each)",
                               cls.__name__, ", ".join(ascii(k) for k in ignored)[:500])
        return data
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: Float | None = Field(None, ge=0)  # no upper bound, as vLLM (OpenAI caps at 2)
    top_p: Float | None = Field(None, gt=0, le=1)
    presence_penalty: Float | None = Field(None, ge=-2, le=2)
    frequency_penalty: Float | None = Field(None, ge=-2, le=2)
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: the response's id (after its "cmpl-" / "chatcmpl-"); the X-Request-Id header, if any, wins
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    logit_bias: dict[str, Float] | None = None
    # extras (vLLM's names)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: Float | None = Field(None, ge=0, le=1)
    repetition_penalty: Float | None = Field(None, gt=0, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: the prompt's token logprobs, top-N each
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**31 - 1)  # vLLM's: keep the last N (-1: max_model_len)
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response too
    # vLLM's structured outputs: {"json": schema} | {"regex": ...} | {"choice": [...]} | {"grammar": ...} |
    # {"json_object": true}, and its older guided_* fields (one of them per request)
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: sample only among these
    bad_words: Annotated[list[StrictStr], Field(max_length=256)] | None = None  # vLLM's: words never in the output
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None  # (with a JSON grammar: a 400, see structured.py)
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it on completions too


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=2**31 - 1)  # (0 only with echo: the prompt alone, for scoring)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=64)


class TextPart(OpenAIBase):
    """A text part. OpenAI's `refusal` part (an assistant's earlier answer, replayed in the history) and the
    Responses API's `input_text` / `output_text` read as text, as vLLM reads them."""
    type: Literal["text"]
    text: StrictStr

    @model_validator(mode="before")
    @classmethod
    def _text_like(cls, v):
        if isinstance(v, dict) and v.get("type") in _TEXT_LIKE:
            key = "refusal" if v["type"] == "refusal" else "text"
            v = {"type": "text", "text": v.get(key)}
        return v


_TEXT_LIKE = ("refusal", "input_text", "output_text")


class MediaURL(OpenAIBase):
    url: StrictStr
    detail: str | None = None  # accepted for OpenAI compatibility; images are encoded at the model's size


class ImageURLPart(OpenAIBase):
    type: Literal["image_url"]
    image_url: MediaURL | StrictStr


class VideoURLPart(OpenAIBase):
    """Not in OpenAI's API (vLLM's extension): a clip as an animated GIF / WebP, data: or http(s)."""
    type: Literal["video_url"]
    video_url: MediaURL | StrictStr


_PART_TAGS = {"text": "<text-part>", "image_url": "<image_url-part>", "video_url": "<video_url-part>",
              **{t: "<text-part>" for t in _TEXT_LIKE}}
Part = Annotated[
    Union[Annotated[TextPart, Tag("<text-part>")], Annotated[ImageURLPart, Tag("<image_url-part>")],
          Annotated[VideoURLPart, Tag("<video_url-part>")]],
    Discriminator(lambda v: _PART_TAGS.get(v.get("type") if isinstance(v, dict) else getattr(v, "type", None)),
                  custom_error_type="part_type",
                  custom_error_message="must be a text, image_url or video_url part")]
Content = Annotated[
    Union[Annotated[StrictStr, Tag("<text>")], Annotated[list[Part], Tag("<parts>")]],
    Discriminator(lambda v: "<text>" if isinstance(v, str) else "<parts>" if isinstance(v, list) else None,
                  custom_error_type="content_type",
                  custom_error_message="must be a string or a list of text, image_url or video_url parts")]


class ChatMessage(OpenAIBase):
    # any role, as vLLM: the chat template decides what it accepts (a role it rejects is a 400 naming 'messages')
    role: Annotated[StrictStr, Field(min_length=1)]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, for the template to render
    tool_call_id: str | None = None  # which call a tool message answers


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # OpenAI's: false allows one call at most
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the answer continues the last message (add_generation_prompt off)
    chat_template: StrictStr | None = None  # vLLM's: this request's template (--trust-request-chat-template)
    echo: bool = False  # vLLM's: the answer's content starts with the last message's, when that is the assistant's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1_000_000)]


# -- responses (documented in the OpenAPI schema; handlers build plain dicts for speed) ------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
