"""The scheduler's decision for one step, as plain data. The model runner turns it into tensors."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the new tokens to run this step
    start_pos: int  # tokens already in the KV cache (num_computed_tokens before this step)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this chunk reaches the end of the known tokens
    sampling_params: SamplingParams
    # References (not copies) for penalties and min_tokens; read only by the sampler.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    want_prompt_logprobs: bool = False


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished since the last step: drop their state

    @property
    def is_empty(self) -> bool:
        return not self.seqs
