"""LLMEngine: text in, text out. Tokenizes and validates requests, fans out n > 1, drives EngineCore,
detokenizes, applies stop strings, and assembles vLLM-shaped RequestOutputs."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field, replace

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore, EngineCoreOutput, EngineStats
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sample.sampler import TokenLogprobs
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")

PromptType = "str | list[int] | dict"


@dataclass
class _Completion:
    index: int
    request_id: str
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[_Completion]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(
            config.tokenizer or config.model, config.trust_remote_code)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer, self.core.model_config.hf_config)
        self.vocab_size = self.core.model_config.vocab_size
        self.states: dict[str, _RequestState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}
        self._counter = 0

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- input ---------------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"'prompt' must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("'prompt' must not be empty")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"'prompt' token ids must be integers in [0, {self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"'prompt' is {len(token_ids)} tokens; it must be shorter than "
                             f"max_model_len ({self.max_model_len}) to leave room for output")

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("'sampling_params' must be a SamplingParams")
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids)
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise ValueError("'stop' strings need a tokenizer")
        arrival = arrival_time or time.time()
        params = replace(params, eos_token_ids=self.eos_token_ids)
        comps, leader = [], None
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params if params.seed is None or i == 0 else replace(params, seed=params.seed + i)
            req = Request(child_id, ids, child_params, arrival_time=arrival, priority=priority, prefix_leader=leader)
            leader = leader or req
            detok = None if self.tokenizer is None else IncrementalDetokenizer(
                self.tokenizer, ids, params.skip_special_tokens, params.stop, params.include_stop_str_in_output)
            comps.append(_Completion(i, child_id, detok, logprobs=[] if params.logprobs is not None else None,
                                     cumulative_logprob=0.0 if params.logprobs is not None else None))
            self._child_to_parent[child_id] = (request_id, i)
            self.core.add_request(req)
        self.states[request_id] = _RequestState(request_id, text, ids, params, comps, RequestMetrics(arrival),
                                                prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        return request_id

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            st = self.states.pop(rid, None)
            if st is None:
                continue
            for c in st.completions:
                self._child_to_parent.pop(c.request_id, None)
            self.core.abort([c.request_id for c in st.completions])

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns an output (cumulative) for every request that progressed."""
        now = time.time()
        touched: dict[str, _RequestState] = {}
        for o in self.core.step():
            parent = self._child_to_parent.get(o.request_id)
            if parent is None:
                continue
            st = self.states[parent[0]]
            self._apply(st, st.completions[parent[1]], o, now)
            touched[st.request_id] = st
        outs = []
        for st in touched.values():
            outs.append(self._make_output(st))
            if st.finished:
                st.metrics.finished_time = now
                del self.states[st.request_id]
                for c in st.completions:
                    self._child_to_parent.pop(c.request_id, None)
        return outs

    def _apply(self, st: _RequestState, c: _Completion, o: EngineCoreOutput, now: float) -> None:
        if o.prompt_logprobs:
            st.prompt_logprobs.extend(self._logprob_dict(r) for r in o.prompt_logprobs)
        if not o.new_token_ids:
            return
        st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
        if st.metrics.first_token_time is None:
            st.metrics.first_token_time = now
        st.metrics.last_token_time = now
        c.token_ids.extend(o.new_token_ids)
        for row in o.logprobs:
            c.logprobs.append(self._logprob_dict(row))
            c.cumulative_logprob += row[0][1]
        c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        if c.detok is not None:
            stop = c.detok.update(o.new_token_ids)
            if stop is not None:
                if c.finish_reason is None:
                    self.core.finish_request(c.request_id, RequestStatus.FINISHED_STOPPED, stop)
                c.finish_reason, c.stop_reason = "stop", stop

    def _logprob_dict(self, row: TokenLogprobs) -> dict[int, Logprob]:
        out = {}
        for tok, lp, rank in row:
            if tok not in out:
                text = self.tokenizer.decode([tok]) if self.tokenizer is not None else None
                out[tok] = Logprob(lp, rank, text)
        return out

    def _make_output(self, st: _RequestState) -> RequestOutput:
        comps = [CompletionOutput(
            index=c.index,
            text=c.detok.visible_text(c.finish_reason is not None) if c.detok else "",
            token_ids=list(c.token_ids), cumulative_logprob=c.cumulative_logprob,
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in st.completions]
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, comps, st.finished,
                             prompt_logprobs=st.prompt_logprobs, num_cached_tokens=st.num_cached_tokens,
                             metrics=st.metrics)

    # -- introspection ------------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def check_invariants(self) -> None:
        self.core.check_invariants()
