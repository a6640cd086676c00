"""Core outputs (token ids) -> RequestOutputs (text): detokenization, stop strings, logprob dicts,
n > 1 reassembly. Shared by LLMEngine (cumulative outputs) and AsyncLLM (delta outputs for streaming)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.core import EngineCoreOutput
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sample.sampler import TokenLogprobs
from tokenmill.sampling_params import SamplingParams


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
    # delta mode: how much has been handed out already
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


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
    sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        for c in self.completions:  # a plain loop: this runs several times per token
            if c.finish_reason is None:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, delta: bool = False):
        self.tokenizer = tokenizer
        self.delta = delta
        self.states: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, prompt: str | None, req: EngineCoreRequest) -> None:
        p, ids = req.params, req.prompt_token_ids
        comps = []
        for i, cid in enumerate(req.child_ids):
            detok = None if self.tokenizer is None or not p.detokenize else IncrementalDetokenizer(
                self.tokenizer, ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output, p.min_tokens)
            comps.append(_Completion(i, cid, detok, logprobs=[] if p.logprobs is not None else None,
                                     cumulative_logprob=0.0 if p.logprobs is not None else None))
            self.child_to_parent[cid] = (req.request_id, i)
        self.states[req.request_id] = _RequestState(
            req.request_id, prompt, ids, p, comps, RequestMetrics(req.arrival_time),
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None)

    def abort(self, request_ids) -> list[str]:
        """Forget the requests; returns the child ids the core must abort."""
        children = []
        for rid in request_ids:
            st = self.states.pop(rid, None)
            if st is None:
                continue
            for c in st.completions:
                self.child_to_parent.pop(c.request_id, None)
                children.append(c.request_id)
        return children

    def process(self, core_outputs: list[EngineCoreOutput], now: float, final_only: bool = False
                ) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns an output for every request that progressed (`final_only`: that finished), and (child id,
        stop string) pairs whose stop string matched: the core must finish those."""
        touched: dict[str, _RequestState] = {}
        stopped: list[tuple[str, str]] = []
        for o in core_outputs:
            parent = self.child_to_parent.get(o.request_id)
            if parent is None:
                continue
            st = self.states[parent[0]]
            c = st.completions[parent[1]]
            if c.finish_reason is not None:
                continue  # tokens the core made before it heard about our stop-string finish
            if o.prompt_logprobs and parent[1] != 0:
                o.prompt_logprobs = []  # n > 1: every sample scores the same prompt; keep one copy
            stop = self._apply(st, c, o, now)
            if stop is not None:
                stopped.append((c.request_id, stop))
            touched[st.request_id] = st
        outs = []
        for st in touched.values():
            if final_only and not st.finished:
                continue  # LLM.generate reads finished outputs only: building the others costs a copy each step
            outs.append(self._make_output(st))
            if st.finished:
                st.metrics.finished_time = now
                del self.states[st.request_id]
                for c in st.completions:
                    self.child_to_parent.pop(c.request_id, None)
        return outs, stopped

    def _apply(self, st: _RequestState, c: _Completion, o: EngineCoreOutput, now: float) -> str | None:
        if o.prompt_logprobs:
            st.prompt_logprobs.extend(self._logprob_dict(r, st.params.detokenize) for r in o.prompt_logprobs)
        if not o.new_token_ids:
            if o.finish_reason is not None:  # ended by the core without a token (a grammar that failed there)
                c.finish_reason = o.finish_reason
            return None
        st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
        if st.metrics.first_token_time is None:
            st.metrics.first_token_time = now
        st.metrics.last_token_time = now
        ids, stop = o.new_token_ids, None
        if c.detok is not None:
            # "stop" from the core: a stop token id or EOS (stop strings are matched here)
            stop = c.detok.update(ids, o.finish_reason == "stop")
            if stop is not None:
                ids = ids[:c.detok.num_used]  # tokens past the stop string (one step may bring several)
        c.token_ids.extend(ids)
        for row in o.logprobs[:len(ids)]:
            c.logprobs.append(self._logprob_dict(row, st.params.detokenize))
            c.cumulative_logprob += row[0][1]
        c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        if stop is not None:
            newly = c.finish_reason is None
            c.finish_reason, c.stop_reason = "stop", stop
            return stop if newly else None
        return None

    def _logprob_dict(self, row: TokenLogprobs, detokenize: bool = True) -> dict[int, Logprob]:
        out = {}
        for tok, lp, rank in row:
            if tok not in out:
                text = self.tokenizer.decode([tok]) if self.tokenizer is not None and detokenize else None
                out[tok] = Logprob(lp, rank, text)
        return out

    def _make_output(self, st: _RequestState) -> RequestOutput:
        if self.delta:
            comps = [self._delta(c) for c in st.completions]
            plp = st.prompt_logprobs
            if plp is not None:
                plp, st.sent_prompt_logprobs = plp[st.sent_prompt_logprobs:], len(plp)
            if st.finished:
                extra = {"num_generated": sum(len(c.token_ids) for c in st.completions)}
                return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, comps, True, plp,
                                     st.num_cached_tokens, st.metrics, extra)
        else:
            comps = [CompletionOutput(
                index=c.index,
                text=c.detok.visible_text(c.finish_reason is not None) if c.detok else "",
                token_ids=list(c.token_ids), cumulative_logprob=c.cumulative_logprob,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in st.completions]
            plp = st.prompt_logprobs
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, comps, st.finished,
                             prompt_logprobs=plp, num_cached_tokens=st.num_cached_tokens,
                             metrics=st.metrics)

    @staticmethod
    def _delta(c: _Completion) -> CompletionOutput:
        """What is new since the last output. finish_reason is reported once, on the final delta."""
        done = c.finish_reason is not None
        text = c.detok.visible_text(done) if c.detok else ""
        new_text, c.sent_text = text[c.sent_text:], len(text)
        new_ids, n0 = c.token_ids[c.sent_tokens:], c.sent_tokens
        c.sent_tokens = len(c.token_ids)
        finish = None
        if done and not c.sent_finish:
            c.sent_finish, finish = True, c.finish_reason
        return CompletionOutput(
            index=c.index, text=new_text, token_ids=new_ids, cumulative_logprob=c.cumulative_logprob,
            logprobs=c.logprobs[n0:] if c.logprobs is not None else None,
            finish_reason=finish, stop_reason=c.stop_reason if finish else None)
