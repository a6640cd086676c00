"""Plain data that crosses the API-server <-> engine-core process boundary (msgpack via msgspec).

The API process sends one `EngineCoreRequest` per user request (n > 1 fans out in the core, where the
children can share the leader's prompt blocks); the core answers with `CoreOutputs` batches, one per step.
"""
from __future__ import annotations

from dataclasses import replace

import msgspec

from tokenmill.engine.core import EngineCoreOutput, EngineStats
from tokenmill.engine.request import Request
from tokenmill.multimodal.inputs import MultiModalItem
from tokenmill.sampling_params import SamplingParams

# CoreOutputs.errors messages with this prefix are engine faults (HTTP 500), not bad input (400).
INTERNAL_ERROR_PREFIX = "internal error: "


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    child_ids: list[str]  # one per sample (n); equal to [request_id] when n == 1
    prompt_token_ids: list[int]
    params: SamplingParams  # eos_token_ids already filled in
    arrival_time: float
    priority: int = 0
    mm_items: list[MultiModalItem] = []  # images / video frames, their placeholders already in the prompt

    def to_requests(self) -> list[Request]:
        """The core-side Request objects; child i gets seed + i so n samples differ but stay reproducible."""
        reqs, leader = [], None
        p = self.params
        for i, cid in enumerate(self.child_ids):
            cp = p if p.seed is None or i == 0 else replace(p, seed=(p.seed + i) % 2**64)
            req = Request(cid, self.prompt_token_ids, cp, arrival_time=self.arrival_time,
                          priority=self.priority, prefix_leader=leader, mm_items=list(self.mm_items))
            leader = leader or req
            reqs.append(req)
        return reqs


class AbortRequests(msgspec.Struct, tag="abort"):
    child_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish"):
    """Stop strings are matched on text in the API process; the core must then free the request."""
    child_ids: list[str]
    stop_reasons: list[str]


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class UtilityCall(msgspec.Struct, tag="call"):
    call_id: int
    method: str  # "stats" | "check_invariants" | "reset_prefix_cache"


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


CoreInput = AddRequest | AbortRequests | FinishRequests | UtilityCall | Shutdown


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # first output of a request: when the scheduler first ran it (for queue-time metrics)
    first_scheduled: dict[str, float] = {}
    # requests the core refused (e.g. duplicate id): child id -> message
    errors: dict[str, str] = {}


class UtilityResult(msgspec.Struct, tag="result"):
    call_id: int
    result: EngineStats | None = None
    error: str | None = None


class Ready(msgspec.Struct, tag="ready"):
    num_kv_blocks: int
    max_model_len: int


class CoreDead(msgspec.Struct, tag="dead"):
    error: str


CoreMessage = CoreOutputs | UtilityResult | Ready | CoreDead
