"""What the worker remembers about each request between steps (vLLM v1's CachedRequestState), so that the
scheduler's per-step output can stay a small diff of plain data (sched/output.py):

    NewRequestData      -> RequestState(prompt, output so far, params, whole block table)
    ScheduledRequest    -> block_ids += new_block_ids; input tokens = tokens[start_pos : start_pos + n]
    tokens it samples   -> output_token_ids += sampled
    new_output_token_ids -> output_token_ids[output_start:] = them (pipeline stages that do not sample)
    preempted_ids       -> block_ids = []  (tokens and the seeded generator stay: it resumes where it was)
    finished_ids        -> state and generator dropped
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.request import token_range
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.output import NewRequestData, SchedulerOutput


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    mm_items: list = field(default_factory=list)  # multimodal/inputs.py MultiModalItem, in prompt order
    grammar: object = None  # sample/grammar.py RequestGrammar, made at the first step that samples (structured outputs)

    def __post_init__(self):
        self.argmax_only = self.sampling_params.argmax_only  # read every step: looked up once
        self.structured = self.sampling_params.structured_outputs is not None

    def takes_argmax(self) -> bool:
        return self.argmax_only and len(self.output_token_ids) >= self.sampling_params.min_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        return token_range(self.prompt_token_ids, self.output_token_ids, start, end)


class RequestStates:
    """Per-request state and seeded generators, kept in step with the scheduler's outputs."""

    def __init__(self, device: str = "cpu"):
        self.device = device  # where seeded generators live: the logits' device
        self.states: dict[str, RequestState] = {}
        self.generators: dict[str, torch.Generator] = {}

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, sched: SchedulerOutput) -> None:
        """Bring the states up to date with this step's decisions (before the model runs)."""
        self.release(sched.finished_ids)
        self.forget_blocks(sched.preempted_ids)
        for seq in sched.seqs:
            if seq.new_request is not None:
                self._install(seq.new_request)
            else:
                st = self.states[seq.request_id]
                st.block_ids.extend(seq.new_block_ids)
                if seq.new_output_token_ids:  # idempotent on the stage that sampled them
                    st.output_token_ids[seq.output_start:] = seq.new_output_token_ids

    def _install(self, new: NewRequestData) -> None:
        # the lists are the scheduler's copies, made for this message: the state takes them over
        self.states[new.request_id] = RequestState(new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                                                   new.block_ids, new.mm_items)

    def forget_blocks(self, request_ids) -> None:
        """Preempted: their block tables are gone (tokens and the seeded generator stay)."""
        for rid in request_ids:
            if rid in self.states:
                self.states[rid].block_ids = []

    def release(self, request_ids) -> None:
        """Drop finished requests' state and generators."""
        for rid in request_ids:
            self.states.pop(rid, None)
            self.generators.pop(rid, None)

    def generator(self, request_id: str) -> torch.Generator | None:
        seed = self.states[request_id].sampling_params.seed
        if seed is None:
            return None
        g = self.generators.get(request_id)
        if g is None:
            # any 64-bit seed (n > 1 children use seed + i) maps onto the generator's unsigned range
            g = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed % 2**64)
        return g
