"""GPU KV-cache sizing by measurement (nano-vllm's way): after the weights load, run one worst-case step
(the most batched tokens, spread over the most sequences, each sampling a token, so the logits are the
largest they get) on a scratch KV cache, and read the activation peak. The KV cache then gets what is left:

    kv bytes = total * gpu_memory_utilization - used now (weights, CUDA context, others) - activation peak
"""
from __future__ import annotations

from dataclasses import dataclass

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


def worst_case_step(lengths: list[int], block_size: int) -> SchedulerOutput:
    """A step that prefills `lengths` dummy prompts whole, each on its own blocks, each sampling greedily."""
    seqs, next_block = [], 0
    for i, n in enumerate(lengths):
        blocks = list(range(next_block, next_block + cdiv(n, block_size)))
        next_block += len(blocks)
        new = NewRequestData(f"profile-{i}", [0] * n, [], SamplingParams(temperature=0.0, max_tokens=1), blocks)
        seqs.append(ScheduledRequest(new.request_id, 0, n, [], 1, new_request=new))
    return SchedulerOutput(seqs=seqs, num_scheduled_tokens=sum(lengths))


def run_worst_case_step(make_runner, lengths: list[int], block_size: int) -> None:
    """make_runner(num_blocks) -> a ModelRunner on a scratch cache just big enough for the step."""
    runner = make_runner(sum(cdiv(n, block_size) for n in lengths))
    step = worst_case_step(lengths, block_size)
    runner.execute(step)
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
                       scratch_bytes_per_block: int) -> GpuMemoryBudget:
    """Run the worst-case step and account for memory (CUDA)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run_worst_case_step(make_runner, lengths, block_size)
    torch.cuda.synchronize()
    scratch = sum(cdiv(n, block_size) for n in lengths) * scratch_bytes_per_block
    peak = torch.cuda.max_memory_allocated() - before - scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return GpuMemoryBudget(total, utilization, total - free, max(peak, 0))
