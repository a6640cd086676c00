"""A request as the engine core sees it: token ids and progress counters, no text."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its prefix is being loaded from the KV tiers
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    def __init__(self, value: str):
        # a plain attribute, not a property: read per request and step (an enum property costs 15x more)
        self.finished = value in ("stop", "length", "abort")


def token_range(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens start..end of prompt + output, without concatenating the two."""
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p:end - p]
    return prompt[start:] + output[:end - p]


@dataclass
class Request:
    """Every request has `num_computed_tokens` catching up with `num_tokens`; prefill and decode are
    the same rule (vLLM v1), so chunked prefill and preemption need no phases."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    # n > 1 fans out into siblings; followers wait for the leader's prompt to be cached, then share it.
    prefix_leader: "Request | None" = None
    cache_salt: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 until scheduled
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    kv_load_failed: bool = False  # a tier load fell short once: recompute instead of trying again
    kv_loaded: bool = False  # back from a tier load; its next prefix lookup finds the loaded blocks
    blocked_since: int | None = None  # the scheduler step since which it has waited for KV room (None: not)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify at its next step
    spec_placeholders: bool = False  # those drafts are placeholders (DraftPolicy's priced looks)
    mm_items: list = field(default_factory=list)  # multimodal/inputs.py MultiModalItem, in prompt order
    # async scheduling: tokens that steps still in flight sample for it (their ids are not back yet)
    num_pending: int = 0
    serial: int = 0  # set by the scheduler on admission: tells a reused request id's incarnations apart
    num_prompt_logprobs_sent: int = 0  # prompt tokens (after the first) whose logprobs went out

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        return token_range(self.prompt_token_ids, self.output_token_ids, start, end)

    def block_extra_keys(self, start: int, end: int) -> tuple:
        """What else besides tokens start..end a cached block must match (see kv/hashing.py): the cache
        salt, and the hash of every image whose placeholders overlap the block, so two prompts with the same
        text but different images never share KV."""
        keys = (self.cache_salt,) if self.cache_salt else ()
        images = tuple(m.hash for m in self.mm_items if m.offset < end and m.end > start)
        return keys + images if images else keys

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def __hash__(self) -> int:
        return hash(self.request_id)

    def __eq__(self, other) -> bool:
        return self is other
