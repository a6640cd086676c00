"""Prompt -> validated token ids -> an EngineCoreRequest. Shared by LLMEngine (in-process) and
AsyncLLM (API process), so both build identical requests (same child ids and seeds)."""
from __future__ import annotations

import contextlib

import json
import logging
import os
from dataclasses import replace

from tokenmill.engine.generation_defaults import sampling_defaults
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.engine.prompt_bound import max_bytes_per_token, utf8_length
from tokenmill.sample.grammar import GrammarCompiler
from tokenmill.tokenizer import load_tokenizer
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


# chat_template_kwargs may set any template variable (add_generation_prompt and tools included, as vLLM lets them)
# but these, which are not the template's
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize", "conversation", "return_dict", "return_tensors",
                                       "continue_final_message"})  # (a field of its own, checked)


def _with_parsed_calls(message: dict) -> dict:
    """A message whose tool calls carry `function.arguments` as a JSON string (OpenAI's form) with them parsed:
    templates read the object, as vLLM gives it to them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"] or "{}")}}
            except ValueError:
                raise ValueError(f"'messages': tool call {call.get('id')!r} has arguments that are not JSON") from None
        parsed.append(call)
    return {**message, "tool_calls": parsed}


def compile_chat_template(text: str) -> None:
    """jinja2.TemplateSyntaxError for a chat template that does not compile in the environment transformers
    renders templates with (loop controls, its `{% generation %}` tag), where a plain jinja2 parse would refuse
    templates that render."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # (a private name: a transformers without it gets jinja2's parse with loop controls)
        import jinja2
        import jinja2.ext

        jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(text)
        return
    _compile_jinja_template(text)


def eos_token_ids(model_path: str, tokenizer, hf_config) -> tuple[int, ...]:
    ids: list[int] = []
    gen = os.path.join(model_path, "generation_config.json")
    sources = []
    if os.path.isfile(gen):
        with open(gen) as f:
            sources.append(json.load(f).get("eos_token_id"))
    sources.append(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for s in sources:
        for t in (s if isinstance(s, list) else [s]):
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def config_tokenizer(config):
    """The tokenizer an EngineConfig names (None with skip_tokenizer_init)."""
    return None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model,
                                                                  config.trust_remote_code)


# OpenAI's part types that hold text ("refusal": an assistant's earlier answer replayed) and their text's key
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _text_parts_joined(message):
    """A text model's message with list content (OpenAI's parts) as its text parts one per line, as vLLM joins
    them and the server does; a part of another kind is refused (the template would fail on the list)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get(_TEXT_PARTS[kind]), str):
            raise ValueError(f"this model takes text parts only ({{'type': 'text', 'text': ...}}); got {kind!r}")
        texts.append(part[_TEXT_PARTS[kind]])
    return {**message, "content": "\n".join(texts)}


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_ids: tuple[int, ...], mm=None,
                 chat_media=None):
        self.tokenizer = tokenizer
        self.mm = mm  # multimodal/processor.py MultiModalProcessor (None: a text-only model)
        self.media_resolvers = chat_media  # (resolve_image, resolve_video, limits) for chat content parts
        self.chat_template: str | None = None  # the server's --chat-template, in place of the tokenizer's
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_ids
        # the model's sampling defaults for what a request leaves unset (engine/generation_defaults.py)
        self.sampling_defaults: dict = {}
        # a text longer than this many bytes cannot fit in max_model_len tokens (None: no safe bound)
        per_token = max_bytes_per_token(tokenizer) if tokenizer is not None else None
        self.max_prompt_bytes = None if per_token is None else int(max_model_len * per_token)
        # structured outputs: parsed here to refuse a bad grammar (the engine compiles it), so a small cache will do
        self.grammars = GrammarCompiler(tokenizer, vocab_size, cache_bytes=64 << 20)

    @classmethod
    def from_config(cls, config, model_config, tokenizer=None) -> "InputProcessor":
        """Load the tokenizer (unless given: `config_tokenizer`'s) and EOS ids for a resolved EngineConfig (the
        same in every process)."""
        tok = tokenizer if tokenizer is not None else config_tokenizer(config)
        mm = chat_media = None
        if model_config.is_multimodal:
            from tokenmill.multimodal.chat import make_resolvers
            from tokenmill.multimodal.processor import MultiModalProcessor

            mm = MultiModalProcessor.from_config(config, model_config, tok)
            chat_media = (*make_resolvers(config.mm_allow_remote_urls, config.mm_fetch_timeout_s,
                                          config.mm_max_fetch_bytes, config.mm_max_image_pixels,
                                          config.mm_video_num_frames), mm.limits)
        ip = cls(tok, model_config.vocab_size, config.max_model_len,
                 eos_token_ids(config.model, tok, model_config.hf_config), mm, chat_media)
        ip.sampling_defaults = sampling_defaults(config.model, config.generation_config,
                                                 config.override_generation_config)
        if ip.sampling_defaults:
            logger.info("sampling defaults for what requests leave unset (generation_config=%s): %s",
                        config.generation_config, ip.sampling_defaults)
        return ip

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "prompt", bounded: bool = True
               ) -> list[int]:
        """Token ids of `text`; a text that cannot fit in max_model_len tokens is refused before it is
        tokenized (see prompt_bound: a large text costs the tokenizer seconds and hundreds of MiB), unless
        not `bounded` (the server's body limit still bounds it)."""
        if bounded and self.max_prompt_bytes is not None and len(text) > self.max_prompt_bytes // 4:
            size = utf8_length(text)
            if size > self.max_prompt_bytes:
                raise ValueError(f"'{field}' is longer than max_model_len ({self.max_model_len} tokens): its {size} "
                                 f"bytes of text make more than {self.max_model_len} tokens")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_media(self, conversation: list[dict]) -> tuple[list[dict], dict | None]:
        """The conversation's media fetched and decoded: (its image / video parts as {"type": "image"} parts,
        the media in order); a text model's text parts joined. Needs no tokenizer: the server runs it on a
        thread pool of its own, so that one request's slow fetches hold up no other's tokenizing."""
        if self.mm is None:
            return [_text_parts_joined(m) for m in conversation], None
        from tokenmill.multimodal.chat import parse_chat_messages

        resolve_image, resolve_video, limits = self.media_resolvers
        return parse_chat_messages(conversation, resolve_image=resolve_image, resolve_video=resolve_video,
                                   limits=limits)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    template_kwargs: dict | None = None, continue_final_message: bool = False,
                    media: tuple[list[dict], dict | None] | None = None) -> dict:
        """A conversation as {"prompt": text, "prompt_token_ids": ids} through the model's chat template.
        `media`: `chat_media(conversation)`'s result, where the caller resolved it already."""
        conversation, mm_data = media if media is not None else self.chat_media(conversation)
        text = self.chat_text(conversation, add_generation_prompt, chat_template, tools, template_kwargs,
                              continue_final_message)
        prompt = {"prompt": text, "prompt_token_ids": self.encode_chat(text)}
        if mm_data and mm_data.get("items"):
            prompt["multi_modal_data"] = mm_data
        return prompt

    def chat_text(self, conversation: list[dict], add_generation_prompt: bool = True,
                  chat_template: str | None = None, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
        """`tools` (function schemas) and `template_kwargs` (e.g. a model's enable_thinking) go to the template,
        as vLLM passes them; a template that does not read them ignores them. `continue_final_message`: the text
        ends inside the last message (no end of turn after it), which the model then continues (an answer's
        given start, as vLLM's)."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("'continue_final_message' continues the last message, 'add_generation_prompt' opens "
                             "a new one: set add_generation_prompt to false")
        if any(m.get("tool_calls") for m in conversation):
            conversation = [_with_parsed_calls(m) for m in conversation]
        kw = {"tools": tools, "add_generation_prompt": add_generation_prompt,
              "continue_final_message": continue_final_message}
        kw.update((k, v) for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS)
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  chat_template=chat_template or self.chat_template, **kw)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def encode_chat(self, text: str) -> list[int]:
        # the template already carries any BOS; don't add special tokens twice
        return self.encode(text, add_special_tokens=False, field="messages")

    def tokenize_prompt(self, prompt, bounded: bool = True) -> tuple[str | None, list[int]]:
        """`bounded`: a text that cannot fit max_model_len is refused before it is tokenized (not when the
        request keeps only the prompt's last tokens, truncate_prompt_tokens)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if ids is None or isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
                    raise ValueError(f"'prompt_token_ids' must be a list of token ids, got {type(ids).__name__}")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
            return prompt, self.encode(prompt, bounded=bounded)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"'prompt' must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("'prompt' must not be empty")
        if len(token_ids) > self.max_model_len:  # first: it is O(1), the value checks are O(len)
            raise ValueError(f"'prompt' is {len(token_ids)} tokens, longer than max_model_len ({self.max_model_len})")
        if not all(type(t) is int for t in token_ids) or min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"'prompt' token ids must be integers in [0, {self.vocab_size})")

    def bad_words_token_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each bad word's token ids as it stands and after a space (as vLLM: a word mid-sentence is usually
        tokenized with its space), the same sequence once."""
        if self.tokenizer is None:
            raise ValueError("'bad_words' need a tokenizer (skip_tokenizer_init=True was set)")
        out: list[tuple[int, ...]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        if any(t >= self.vocab_size for ids in out for t in ids):
            raise ValueError(f"'bad_words' tokenize to ids past the model's vocabulary ({self.vocab_size})")
        return tuple(out)

    def process(self, request_id: str, prompt, params: SamplingParams, arrival_time: float,
                priority: int = 0) -> tuple[str | None, EngineCoreRequest]:
        """Returns the prompt text (if any) and the request for the core. Raises ValueError on bad input."""
        if not isinstance(params, SamplingParams):
            raise ValueError("'sampling_params' must be a SamplingParams")
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data and self.mm is None:
            raise ValueError("this model takes no images or video ('multi_modal_data')")
        media = []
        if self.mm is not None:
            with _naming_the_prompt():
                prompt, media = self.mm.prepare(prompt, mm_data)
        keep = params.truncate_prompt_tokens
        if keep == -1:  # (vLLM's: as many as the context holds)
            keep = self.max_model_len
        elif keep is not None and keep > self.max_model_len:
            raise ValueError(f"'truncate_prompt_tokens' ({keep}) is greater than max_model_len "
                             f"({self.max_model_len}): choose a smaller truncation size")
        text, ids = self.tokenize_prompt(prompt, bounded=keep is None)
        if keep is not None and len(ids) > keep and not media:
            ids, text = ids[-keep:], None  # (the text is the tokens' again, for echo and the output)
        items = []
        if self.mm is not None:
            with _naming_the_prompt():
                ids, items = self.mm.expand(ids, media)
        if keep is not None and media and len(ids) > keep:  # (counted with each image's placeholder tokens)
            # the cut could split an image's placeholder tokens from its pixels
            raise ValueError("'truncate_prompt_tokens' cannot cut a prompt with images or video")
        self.validate(ids)
        if params.stop and self.tokenizer is None:
            raise ValueError("'stop' strings need a tokenizer")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"'logit_bias' token ids must be in [0, {self.vocab_size})")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.vocab_size:
            raise ValueError(f"'allowed_token_ids' must be in [0, {self.vocab_size})")
        if params.structured_outputs is not None and any(t >= self.vocab_size
                                                          for t in params.structured_outputs.start_after):
            raise ValueError(f"'structured_outputs' start_after token ids must be in [0, {self.vocab_size})")
        if params.structured_outputs is not None:  # parsed here to refuse a bad grammar before it is queued
            self.grammars.validate(params.structured_outputs)
        if params.bad_words:
            params = replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        params = replace(params, eos_token_ids=self.eos_token_ids)
        child_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        return text, EngineCoreRequest(request_id, child_ids, ids, params, arrival_time, priority, items)


@contextlib.contextmanager
def _naming_the_prompt():
    """A refused image or video is the prompt's fault: its ValueError names 'prompt' (the server's 400 then names
    the request's field, 'messages' for a chat), whatever other words its message quotes."""
    try:
        yield
    except ValueError as e:
        if "'prompt'" in str(e):
            raise
        raise ValueError(f"'prompt': {e}") from None
