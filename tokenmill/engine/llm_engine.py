"""LLMEngine: text in, text out. Tokenizes and validates requests, fans out n > 1, drives EngineCore,
detokenizes, applies stop strings, and assembles vLLM-shaped RequestOutputs.

Input and output processing live in InputProcessor / OutputProcessor so the API server can run them
in its own process while the core steps in another (engine/async_llm.py)."""
from __future__ import annotations

import logging
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore, EngineStats
from tokenmill.engine.input_processor import InputProcessor, config_tokenizer
from tokenmill.models.loader import load_hf_config
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.request import RequestStatus
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        load_hf_config(config.model)  # (a bad config.json is named as such: the tokenizer reads it too)
        tokenizer = config_tokenizer(config)  # (a broken tokenizer fails before the weights load, not after)
        self.core = EngineCore(config)
        self.input_processor = InputProcessor.from_config(config, self.core.model_config, tokenizer)
        self.tokenizer = self.input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self.states = self.output_processor.states
        self._counter = 0

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # -- input ---------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        params = params or SamplingParams(**self.input_processor.sampling_defaults)
        if request_id is None:
            request_id = str(self._counter)
            self._counter += 1
        if request_id in self.states:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, req = self.input_processor.process(request_id, prompt, params, arrival_time or time.time(), priority)
        added = []
        try:  # one unit: a child left in the core without output state would run with nobody to read it
            for r in req.to_requests():
                self.core.add_request(r)
                added.append(r.request_id)
            self.output_processor.add_request(text, req)
        except BaseException:
            self.core.abort(added)
            raise
        return request_id

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core.abort(self.output_processor.abort(request_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    # -- the step ----------------------------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; returns an output (cumulative) for every request that progressed (`final_only`:
        for every request that finished)."""
        return self._outputs(self.core.step(), final_only)

    def flush(self) -> list[RequestOutput]:
        """Finish a step still in flight (async scheduling; EngineCore.flush)."""
        return self._outputs(self.core.flush())

    def _outputs(self, core_outputs, final_only: bool = False) -> list[RequestOutput]:
        """The request outputs; a stop string matched here finishes its request in the core too (its blocks)."""
        outs, stopped = self.output_processor.process(core_outputs, time.time(), final_only)
        for child_id, stop in stopped:
            self.core.finish_request(child_id, RequestStatus.FINISHED_STOPPED, stop)
        return outs

    # -- introspection ------------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def check_invariants(self) -> None:
        self.core.check_invariants()
