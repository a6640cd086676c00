"""The step contract between the engine core and the worker, as plain data.

The scheduler's `SchedulerOutput` holds copies and ids only (no live references to a Request's lists),
so it pickles or msgpack-encodes as it is and could cross a process boundary to worker processes. The
worker keeps its own per-request state (worker/request_state.py) and updates it from the step's diff:

    SchedulerOutput
      seqs: [ScheduledRequest]             one per request that runs this step
        request_id, start_pos, num_new_tokens   run positions start_pos .. start_pos + num_new_tokens - 1
        new_block_ids                      blocks appended to its block table this step
        num_sampled_positions              0: a prefill chunk short of the prompt's end (nothing sampled)
                                           1: the chunk's last position samples the next token
                                           1 + k: the last token and k drafts, all verified at once
        draft_token_ids                    the k drafts: the step's last k input tokens
        draft_placeholders                 they are placeholders (adaptive speculation pricing a depth): run
                                           and verify them as drafts, keep only the target's first token
        propose_k                          drafts to propose after this step (speculation)
        num_steps                          > 1: greedy decode steps to run in a row (num_scheduler_steps),
                                           each step's token the next one's input; slots are reserved for
                                           them, and the worker returns up to num_steps tokens
        wants_prompt_logprobs
        new_request: NewRequestData | None set the first time the worker sees it, and again after a
                                           preemption (prompt, output so far, params, whole block table)
        output_start, new_output_token_ids pipeline parallelism: tokens sampled since the worker last saw
                                           the request, from output index output_start (stages that do
                                           not sample learn them here)
      preempted_ids                        their block tables are gone; tokens and generator stay
      finished_ids                         finished since the last step: the worker drops their state
      kv_stores: [BlockStore]              blocks evicted this step: copy them down a tier *before* the
                                           forward, which may overwrite them
      kv_backups: [BlockStore]             write-through: blocks that fill this step, copied *after* it
      kv_loads: [KVLoad]                   fill these blocks from the tiers, off the step (async)
      kv_load_cancels                      request ids whose loads to stop (aborted)
      encoder_inputs: [MultiModalItem]     images to encode before this step's forward (not cached yet)
      encoder_prefetch: [MultiModalItem]   images of queued requests: encode them in the worker's encoder
                                           thread (the hashes come back through poll, before a schedule)
      encoder_frees                        image hashes the encoder cache evicted: drop their rows
      placeholder_drafts                   speculation's priced looks: placeholder drafts the scheduler gives
                                           each request after this step (the worker proposes none)

    Load results come back as KVLoadResult, polled before each schedule().

    ModelRunnerOutput (worker/model_runner.py) comes back with a list of token ids per request that
    sampled (the accepted drafts, then one token of the target's), and the drafts for the next step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.multimodal.inputs import MultiModalItem
from tokenmill.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """What the worker keeps about a request, sent once (and again when it resumes after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # [] for a new request; the tokens so far for one resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table (prefix-cache hits first)
    mm_items: list[MultiModalItem] = field(default_factory=list)  # images / frames, with their pixels


@dataclass
class ScheduledRequest:
    # the scheduler builds these positionally (Scheduler._scheduled): a new field goes last
    request_id: str
    start_pos: int  # tokens already in the KV cache (num_computed_tokens before this step)
    num_new_tokens: int  # tokens to run this step
    new_block_ids: list[int]  # appended to the block table this step ([] when new_request carries it all)
    num_sampled_positions: int  # the chunk's last N positions produce tokens (see the module docstring)
    wants_prompt_logprobs: bool = False
    new_request: NewRequestData | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    draft_placeholders: bool = False
    propose_k: int = 0
    num_steps: int = 1
    output_start: int = 0
    new_output_token_ids: list[int] = field(default_factory=list)


@dataclass
class BlockStore:
    block_id: int
    block_hash: bytes


@dataclass
class KVLoad:
    """Read `block_hashes` from the tiers into `block_ids`, in order; `tiers` names where each was found."""
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    tiers: list[int]


@dataclass
class KVLoadResult:
    """The first `num_loaded` blocks of a KVLoad hold their KV; the rest are to be recomputed."""
    request_id: str
    num_loaded: int
    tiers: list[int]  # the tier each loaded block came from
    failed: bool  # something was listed but could not be read (a miss, an error or the deadline)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    burst_steps: int = 1  # the longest burst among seqs (num_steps), 1 when none
    # a single step only because it proposes drafts: without them it would have been a burst (DraftPolicy
    # charges such a depth-0 step what a burst's step costs, which is what depth 0 gives here)
    burst_forgone: bool = False
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # finished since the last step: drop their state
    kv_stores: list[BlockStore] = field(default_factory=list)
    kv_backups: list[BlockStore] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_load_cancels: list[str] = field(default_factory=list)
    encoder_inputs: list[MultiModalItem] = field(default_factory=list)  # encode before this step's forward
    encoder_prefetch: list[MultiModalItem] = field(default_factory=list)  # encode in the worker's thread
    encoder_frees: list[str] = field(default_factory=list)  # image hashes evicted from the encoder cache
    # speculation, scheduler-side: the placeholder drafts each request gets after this step (DraftPolicy.plan's
    # priced looks)
    placeholder_drafts: dict[str, int] = field(default_factory=dict)
    # scheduler-side: each scheduled request's serial, so that a step still in flight when its request finished
    # (async scheduling, pipeline stages) never updates a new request that reuses the id
    serials: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.seqs
