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


def worst_case_step(lengths: list[int], block_size: int, spare_tokens: int = 0) -> SchedulerOutput:
    """A step that prefills `lengths` dummy prompts whole, each on its own blocks (with room for `spare_tokens`
    more), each sampling with every sampler feature, the longest also asking for prompt logprobs."""
    seqs, next_block = [], 0
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + cdiv(n + spare_tokens, block_size)))
        next_block += len(blocks)
        params = replace(WORST_CASE_SAMPLING, prompt_logprobs=20 if i == longest else None)
        new = NewRequestData(f"profile-{i}", [0] * n, [], params, blocks)
        seqs.append(ScheduledRequest(new.request_id, 0, n, [], 1, wants_prompt_logprobs=i == longest,
                                     new_request=new))
    return SchedulerOutput(seqs=seqs, num_scheduled_tokens=sum(lengths))


def worst_case_verification(prefill: SchedulerOutput, num_drafts: int, max_tokens: int) -> SchedulerOutput:
    """Speculative decoding's biggest step after `prefill`: as many of its sequences as the token budget lets
    verify `num_drafts` drafts each, k + 1 logits rows per sequence (up to max_tokens rows, against the
    prefill's one per sequence)."""
    n = min(len(prefill.seqs), max_tokens // (num_drafts + 1))
    seqs = [ScheduledRequest(s.request_id, s.num_new_tokens, num_drafts + 1, [], num_drafts + 1,
                             draft_token_ids=[0] * num_drafts) for s in prefill.seqs[:n]]
    return SchedulerOutput(seqs=seqs, num_scheduled_tokens=n * (num_drafts + 1))


def run_worst_case_step(make_runner, lengths: list[int], block_size: int, num_drafts: int = 0) -> None:
    """make_runner(num_blocks) -> a ModelRunner on a scratch cache just big enough for the steps: the worst-case
    prefill, then (speculative decoding's `num_drafts`) the worst-case verification."""
    spare = num_drafts + 1 if num_drafts else 0
    runner = make_runner(sum(cdiv(n + spare, block_size) for n in lengths))
    step = worst_case_step(lengths, block_size, spare)
    runner.execute(step)
    if num_drafts:
        runner.execute(worst_case_verification(step, num_drafts, sum(lengths)))
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


def measure_gpu_budget(make_runner, lengths: list[int], block_size: int, utilization: float,
                       scratch_bytes_per_block: int, num_drafts: int = 0) -> GpuMemoryBudget:
    """Run the worst-case step and account for memory (CUDA)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_worst_case_step(make_runner, lengths, block_size, num_drafts)
    torch.cuda.synchronize()
    spare = num_drafts + 1 if num_drafts else 0
    scratch = sum(cdiv(n + spare, block_size) for n in lengths) * scratch_bytes_per_block
    peak = torch.cuda.max_memory_allocated() - before - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return GpuMemoryBudget(total, utilization, total - free, max(peak, 0))
