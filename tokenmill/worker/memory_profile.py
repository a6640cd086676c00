"""GPU KV-cache sizing by measurement (nano-vllm's way): after the weights load, run one worst-case step
(the most batched tokens, spread over the most sequences, each sampling a token with every sampler feature,
so the logits and the sampler's temporaries are the largest they get; with speculative decoding, then the
largest verification) on a scratch KV cache, and read the activation peak. The KV cache then gets what is left:

    kv bytes = total * gpu_memory_utilization - used now (weights, CUDA context, others) - activation peak
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.kv.manager import cdiv
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput

GIB = 2**30


def worst_case_lengths(max_tokens: int, max_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the worst-case step: max_tokens over as many sequences as may run (each one sampled
    row of logits), none longer than max_model_len."""
    n = max(min(max_seqs, max_tokens), cdiv(max_tokens, max_model_len))
    base, extra = divmod(max_tokens, n)
    return [base + (i < extra) for i in range(n)]


# What the sampler can be asked for at once: its [rows, vocab] temporaries (penalty counts, the sort for top-k /
# top-p, the softmaxes, the noise, logprobs' log-softmax) are part of the peak, as vLLM's dummy sampler run
# counts them. A greedy profile would leave them to the headroom, and a large vocabulary at many sequences
# needs gigabytes (256 rows x 128K x 4 bytes is 128 MiB per temporary).
WORST_CASE_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                     presence_penalty=0.5, frequency_penalty=0.5, logprobs=20, max_tokens=1)


@dataclass
class WorstCase:
    """The profile's steps, on a scratch cache of `scratch_blocks` blocks:

      prefill        `lengths` dummy prompts whole, each on its own blocks, each sampling with every sampler
                     feature (WORST_CASE_SAMPLING), the longest also asking for prompt logprobs; with speculative
                     decoding each then proposes k drafts (a draft model's catch-up over every prompt whole,
                     then its k - 1 steps: its largest forwards);
      verification   with speculative decoding (`num_drafts` = k), as many of those sequences as the token budget
                     lets verify k drafts each (k + 1 logits rows per sequence, against the prefill's one), as the
                     scheduler would: never past max_model_len, never past the budget."""
    lengths: list[int]
    block_size: int
    max_model_len: int
    num_drafts: int = 0

    @classmethod
    def for_limits(cls, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                   num_drafts: int = 0) -> "WorstCase":
        # with speculation the prompts leave room for a verification (k + 1 positions past the prompt)
        longest = max(max_model_len - num_drafts - 1, 1) if num_drafts else max_model_len
        return cls(worst_case_lengths(max_tokens, max_seqs, longest), block_size, max_model_len, num_drafts)

    @property
    def _spare(self) -> int:
        return self.num_drafts + 1 if self.num_drafts else 0

    @property
    def scratch_blocks(self) -> int:
        return sum(cdiv(n + self._spare, self.block_size) for n in self.lengths)

    def prefill(self) -> SchedulerOutput:
        seqs, next_block = [], 0
        longest = max(range(len(self.lengths)), key=self.lengths.__getitem__)
        for i, n in enumerate(self.lengths):
            blocks = list(range(next_block, next_block + cdiv(n + self._spare, self.block_size)))
            next_block += len(blocks)
            # (every other row without top-k: a batch where some row has none sorts its whole rows, the
            # sampler's largest temporaries; with a top-k on every row it reads only their heads)
            params = replace(WORST_CASE_SAMPLING, prompt_logprobs=20 if i == longest else None,
                             top_k=WORST_CASE_SAMPLING.top_k if i % 2 == 0 else 0)
            new = NewRequestData(f"profile-{i}", [0] * n, [], params, blocks)
            seqs.append(ScheduledRequest(new.request_id, 0, n, [], 1, wants_prompt_logprobs=i == longest,
                                         propose_k=self.num_drafts, new_request=new))
        return SchedulerOutput(seqs=seqs, num_scheduled_tokens=sum(self.lengths))

    def verification(self, prefill: SchedulerOutput) -> SchedulerOutput | None:
        """After `prefill` (each sequence's prompt and its sampled token); None where no sequence can verify."""
        seqs, budget = [], sum(self.lengths)
        for s in prefill.seqs:
            # the scheduler's limits (_fit_drafts): positions n .. n + k inside max_model_len, k + 1 in the budget
            k = min(self.num_drafts, self.max_model_len - s.num_new_tokens - 1, budget - 1)
            if k <= 0:
                continue
            seqs.append(ScheduledRequest(s.request_id, s.num_new_tokens, k + 1, [], k + 1, draft_token_ids=[0] * k))
            budget -= k + 1
        return SchedulerOutput(seqs=seqs, num_scheduled_tokens=sum(x.num_new_tokens for x in seqs)) if seqs else None

    def run(self, make_runner) -> None:
        """make_runner(num_blocks) -> a ModelRunner (on a scratch cache of scratch_blocks blocks)."""
        runner = make_runner(self.scratch_blocks)
        step = self.prefill()
        runner.execute(step)
        verification = self.verification(step) if self.num_drafts else None
        if verification is not None:
            runner.execute(verification)
        runner.release_requests([s.request_id for s in step.seqs])


@dataclass
class GpuMemoryBudget:
    total: int
    utilization: float
    used: int  # by this process's weights, the CUDA context and anything else on the device
    activation_peak: int  # one worst-case step

    @property
    def kv_bytes(self) -> int:
        return int(self.total * self.utilization) - self.used - self.activation_peak

    def describe(self) -> str:
        return (f"{self.total / GIB:.2f} GiB total x gpu_memory_utilization {self.utilization} = "
                f"{self.total * self.utilization / GIB:.2f} GiB; in use before the KV cache (weights, CUDA context, "
                f"other processes) {self.used / GIB:.2f} GiB; one worst-case step's activations "
                f"{self.activation_peak / GIB:.2f} GiB; left for the KV cache {max(self.kv_bytes, 0) / GIB:.2f} GiB")


def measure_gpu_budget(make_runner, worst: WorstCase, utilization: float,
                       scratch_bytes_per_block: int) -> GpuMemoryBudget:
    """Run the worst-case steps and account for memory (CUDA)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    worst.run(make_runner)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - worst.scratch_blocks * scratch_bytes_per_block
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return GpuMemoryBudget(total, utilization, total - free, max(peak, 0))
