"""POST /v1/chat/completions: messages through the model's chat template, then the same engine path."""
from __future__ import annotations

import time
from dataclasses import replace

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.engine.input_processor import compile_chat_template
from tokenmill.engine.async_llm import AsyncLLM
from tokenmill.entrypoints.openai.errors import APIError
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.entrypoints.openai.serving_engine import ChunkEvents, ServingBase, engine_errors, usage
from tokenmill.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, Reasoning, ReasoningParser
from tokenmill.entrypoints.openai.structured import ForcedToolCalls, grammar_field, tool_functions
from tokenmill.entrypoints.openai.tool_parsers import AutoToolCalls
from tokenmill.sampling_params import SamplingParams


def request_chat_template(template: str | None, trusted: bool) -> str | None:
    """A request's own `chat_template` (vLLM's field), which only a server started with
    --trust-request-chat-template takes: a template is code the server runs for every request that sends it
    (sandboxed by transformers, but its loops are not bounded)."""
    if template is None:
        return None
    if not trusted:
        raise APIError(400, "this server takes no chat template from requests; start it with "
                            "--trust-request-chat-template to allow them", "chat_template")
    try:
        compile_chat_template(template)
    except jinja2.TemplateError as e:
        raise APIError(400, f"chat_template does not compile: {e}", "chat_template") from None
    return template


async def render_chat(engine: AsyncLLM, messages: list[ChatMessage], add_generation_prompt: bool = True,
                      template_kwargs: dict | None = None, tools: list[dict] | None = None,
                      continue_final_message: bool = False, chat_template: str | None = None) -> dict:
    """The prompt as {"prompt": text, "prompt_token_ids": ids}, exactly as LLM.chat builds it, rendered and
    tokenized on the tokenizer thread. `chat_template`: a request's own, checked by request_chat_template."""
    if engine.tokenizer is None or not (chat_template or engine.input_processor.has_chat_template):
        raise APIError(400, "this model has no chat template; start the server with --chat-template, or use "
                            "/v1/completions", "messages")
    if continue_final_message and add_generation_prompt:
        raise APIError(400, "'continue_final_message' continues the last message and 'add_generation_prompt' "
                            "opens a new one: set 'add_generation_prompt' to false", "continue_final_message")
    multimodal = engine.input_processor.mm is not None
    convo = []
    for m in messages:
        if isinstance(m.content, str) or m.content is None:
            content = m.content or ""
        elif multimodal:  # parts go to multimodal/chat.py as they came
            content = [p.model_dump(exclude_none=True) for p in m.content]
        elif any(p.type != "text" for p in m.content):
            raise APIError(400, "this model takes no images or video; send text parts only", "messages")
        else:
            content = _text_of(m.content)
        message = {"role": m.role, "content": content}
        for key in ("name", "tool_call_id"):  # for templates that render an agent's history
            if (value := getattr(m, key)) is not None:
                message[key] = value
        if m.tool_calls is not None:
            message["tool_calls"] = m.tool_calls
        convo.append(message)
    media = None
    if multimodal:  # fetched and decoded on the media threads: a slow fetch holds up no other request's tokenizing
        with engine_errors("messages", only_field=True):  # (a bad image is a 400 naming 'messages')
            media = await engine.run_media(engine.input_processor.chat_media, convo)
    return await engine.run_tokenizer(_render, engine, convo, add_generation_prompt, template_kwargs, tools,
                                      continue_final_message, chat_template, media)


def _render(engine: AsyncLLM, convo: list[dict], add_generation_prompt: bool, template_kwargs: dict | None,
            tools: list[dict] | None = None, continue_final_message: bool = False,
            chat_template: str | None = None, media=None) -> dict:
    """Template + tokenize; for a multimodal model with its images already fetched and decoded (`media`,
    InputProcessor.chat_media's)."""
    ip = engine.input_processor
    if ip.mm is not None:
        with engine_errors("messages", only_field=True):
            try:
                return ip.chat_prompt(convo, add_generation_prompt, chat_template, tools, template_kwargs,
                                      continue_final_message, media)
            except (TypeError, KeyError, AttributeError, jinja2.TemplateError) as e:  # e.g. a role it refuses
                raise APIError(400, f"chat template failed: {e}", "messages") from None
    try:
        text = ip.chat_text(convo, add_generation_prompt, chat_template, tools, template_kwargs,
                            continue_final_message)
    except Exception as e:  # jinja errors from the template (e.g. role order it rejects)
        raise APIError(400, f"chat template failed: {e}", "messages") from None
    with engine_errors("messages"):  # a rendered prompt too long for the context: 400 naming 'messages'
        return {"prompt": text, "prompt_token_ids": ip.encode_chat(text)}


class OpenAIServingChat(ServingBase):
    tool_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice (tool_parsers.py)
    reasoning_parser: str | None = None  # --reasoning-parser (reasoning_parsers.py)
    trust_request_chat_template = False  # --trust-request-chat-template: requests may bring their own
    response_role = "assistant"  # --response-role: the answer's role where a generation prompt opens it

    def role(self, req: ChatCompletionRequest) -> str:
        """The answer's role, as vLLM's: the server's with a generation prompt; without one the answer
        continues the last message, so it has that message's role."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.check_stream_options(req)
        forced = _tool_calls(req, self.tool_parser)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        template = request_chat_template(req.chat_template, self.trust_request_chat_template)
        prompt = await render_chat(self.engine, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                   req.tools, req.continue_final_message, template)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs, req.prompt_logprobs,
                                      forced.grammar if forced is not None else None)
        if getattr(forced, "keeps_special_tokens", False):  # the tool-call parser reads special tokens
            params.skip_special_tokens = False
        reasoning = self._reasoning(params, prompt["prompt"])
        rid, subs = await self.submit([prompt], params, req.priority, "chatcmpl", "messages",
                                      self.client_request_id(req, raw),
                                      grammar_field(req, forced.grammar if forced is not None else None))
        created = int(time.time())
        if req.stream:
            with self.aborted_on_error(subs):
                return self.stream_response(subs, _ChatEvents(self, req, rid, subs, created, forced, reasoning))
        return await self.respond(raw, subs, lambda: self._full(req, rid, subs, created, forced, reasoning))

    def _reasoning(self, params: SamplingParams, prompt: str) -> Reasoning | None:
        """With --reasoning-parser: the split of each answer, and a grammar held back until the reasoning ends
        (where the model will think first; else the grammar holds the whole output, which then has no
        reasoning)."""
        if self.reasoning_parser is None:
            return None
        so = params.structured_outputs
        if so is None:
            return Reasoning(self.reasoning_parser)
        if not REASONING_PARSERS[self.reasoning_parser].thinks_first(prompt):
            return None
        end = self.engine.tokenizer.encode(ReasoningParser.END, add_special_tokens=False)
        params.structured_outputs = replace(so, start_after=tuple(end))
        return Reasoning(self.reasoning_parser)

    async def _full(self, req: ChatCompletionRequest, rid: str, subs, created: int,
                    forced: ForcedToolCalls | AutoToolCalls | None, reasoning: Reasoning | None) -> Response:
        choices, prompt_rows = await self.collect(subs, req.n)
        top_n, echo, role = req.top_logprobs or 0, _echo(req), self.role(req)
        out = []
        for ch in choices:
            thought, text = reasoning.split(ch.text) if reasoning is not None else (None, ch.text)
            message = {"role": role, "content": text}
            finish = ch.finish_reason
            if forced is not None:
                message = {**forced.message(ch.index, text or ""), "role": role}
                finish = forced.finish_reason(ch.index, message, finish)
            if reasoning is not None:
                message["reasoning_content"] = thought
                if text is None and not message.get("tool_calls"):  # cut off before the answer
                    message["content"] = None
            if echo:
                message["content"] = echo + (message["content"] or "")
            out.append({"index": ch.index, "message": message,
                        "logprobs": self.chat_logprobs(ch.logprobs, top_n) if req.logprobs else None,
                        "finish_reason": finish, "stop_reason": ch.stop_reason,
                        **({"token_ids": ch.token_ids} if req.return_token_ids else {})})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_for(req),
                "choices": out, "usage": usage(len(subs[0][2]), sum(c.num_tokens for c in choices))}
        if req.prompt_logprobs is not None:  # vLLM's place for them in chat: the response
            body["prompt_logprobs"] = self.prompt_logprobs(prompt_rows[0], subs[0][2], req.prompt_logprobs)
        if req.return_token_ids:
            body["prompt_token_ids"] = subs[0][2]
        return Response(msgspec.json.encode(body), media_type="application/json")


def _echo(req: ChatCompletionRequest) -> str:
    """With `echo` (vLLM's), the text each answer's content starts with: the last message's, where the answer
    continues it (add_generation_prompt false, e.g. with continue_final_message) or it is the assistant's."""
    last = req.messages[-1]
    if not req.echo or (req.add_generation_prompt and last.role != "assistant") or last.content is None:
        return ""
    return last.content if isinstance(last.content, str) else _text_of(last.content)


def _text_of(parts) -> str:
    """A message's text parts, one per line, as vLLM joins them (as the template gets them)."""
    return "\n".join(p.text for p in parts if p.type == "text")


def _tool_calls(req: ChatCompletionRequest, parser: str | None) -> ForcedToolCalls | AutoToolCalls | None:
    """tool_choice "required" or a named function: the calls the answer is forced into; "auto" (OpenAI's default
    with tools): the calls the model writes in its own format, read by the server's --tool-call-parser. With
    "none" the tools only go to the template (vLLM's default) and the answer is text."""
    if req.tool_choice is not None and not req.tools:
        raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
    if req.tools:  # whatever the choice (a 400 as OpenAI's and vLLM's, not a template rendering them broken)
        tool_functions(req.tools)
    if not req.tools or req.tool_choice == "none":
        return None
    if req.tool_choice is None and "tool_choice" in req.model_fields_set:  # an explicit null: "none", as vLLM
        return None
    if req.tool_choice in (None, "auto"):
        if parser is None:
            raise APIError(400, "tool_choice 'auto' needs the server started with --enable-auto-tool-choice and "
                                "--tool-call-parser; send 'required', a named function, or 'none' for a text "
                                "answer", "tool_choice")
        return AutoToolCalls(parser, req.parallel_tool_calls)
    return ForcedToolCalls(req.tools, req.tool_choice, req.parallel_tool_calls)


class _ChatEvents(ChunkEvents):
    """SSE chunks of a streamed chat completion (StreamEvents). OpenAI opens each choice with the role and
    empty content; like vLLM, that chunk goes out with the first tokens, so clients that time the first
    chunk measure a real TTFT."""

    def __init__(self, serving: OpenAIServingChat, req: ChatCompletionRequest, rid: str, subs, created: int,
                 forced: ForcedToolCalls | AutoToolCalls | None = None, reasoning: Reasoning | None = None):
        super().__init__(serving, req, rid, "chat.completion.chunk", created, len(subs[0][2]))
        self.opened = False
        # return_token_ids: the prompt's ids go with the first chunk, at its top level (as vLLM)
        self.prompt_ids = b'"prompt_token_ids":' + msgspec.json.encode(subs[0][2]) + b"," if req.return_token_ids \
            else b""
        self.forced, self.reasoning = forced, reasoning

    def on_output(self, k: int, out) -> bytes:
        req, encode = self.req, msgspec.json.encode
        events = []
        if not self.opened:
            self.opened = True
            echo = _echo(req)  # (the opening chunk carries it: the content's start)
            role = self.serving.role(req)
            roles = [encode({"index": i, "delta": {"role": role, "content": echo}, "logprobs": None,
                             "finish_reason": None}) for i in range(req.n)]
            # one choice per chunk, as OpenAI and vLLM send them (clients read choices[0] alone); the prompt's ids
            # go on the first
            events += [self.choice_chunk(i, role, self.num_prompt, 0, self.prompt_ids if i == 0 else b"")
                       for i, role in enumerate(roles)]
        for c in out.outputs:
            if not c.token_ids and c.finish_reason is None:
                continue
            finish, text, thought = c.finish_reason, c.text, ""
            if self.reasoning is not None:
                thought, text = self.reasoning.stream(c.index, c.text, finish is not None)
            if self.forced is None:
                delta = {"content": text} if text or (finish is None and not thought) else {}
            else:
                delta, finish = self._tool_delta(c, text)
            if thought:
                delta = {"reasoning_content": thought, **delta}
            lp = self.serving.chat_logprobs(c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            if not delta and finish is None and lp is None and not self.continuous_usage and not req.return_token_ids:
                self.num_completion += len(c.token_ids)  # required tool calls, held back until they are whole
                continue
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                      "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            events.append(self.choice_chunk(c.index, encode(choice), self.num_prompt, len(c.token_ids)))
        return b"".join(events)

    def _tool_delta(self, c, text: str) -> tuple[dict, str | None]:
        delta = self.forced.stream_delta(c.index, text, c.finish_reason is not None)
        return delta, self.forced.finish_reason(c.index, delta, c.finish_reason)
