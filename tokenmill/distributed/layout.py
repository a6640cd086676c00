"""Where each rank sits, and the checks that a model splits over the requested sizes.

    world rank = pp_rank * tp_size + tp_rank          (rank 0, the driver, runs the scheduler)

    tp=2, pp=2:    stage 0: ranks 0 1    (layers 0 .. L/2 - 1, the embedding)
                   stage 1: ranks 2 3    (layers L/2 .. L - 1, the norm and the LM head)
    TP groups {0, 1} and {2, 3} all-reduce; rank r sends its hidden states to rank r + tp_size.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    @property
    def result_rank(self) -> int:
        """The rank whose sampled tokens the driver takes: TP rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def for_rank(self, rank: int) -> "ParallelLayout":
        return ParallelLayout(self.tp_size, self.pp_size, rank)

    def layer_range(self, num_layers: int, stage: int | None = None) -> tuple[int, int]:
        """Layers [start, end) of a stage: an even split, the first stages taking one more when it is uneven."""
        s = self.pp_rank if stage is None else stage
        base, extra = divmod(num_layers, self.pp_size)
        start = s * base + min(s, extra)
        return start, start + base + (1 if s < extra else 0)

    def shard_spec(self, num_layers: int) -> dict:
        """This rank's ModelShard fields (comm.py) but the TP group."""
        start, end = self.layer_range(num_layers)
        return dict(layer_start=start, layer_end=end, is_first_stage=self.is_first_stage,
                    is_last_stage=self.is_last_stage)


def kv_head_split(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(local KV heads, first checkpoint KV head) of a TP rank. With more ranks than KV heads, each head is
    replicated over tp / num_kv_heads ranks, as vLLM does:

        8 KV heads, tp 4:  rank r holds heads 2r, 2r + 1
        2 KV heads, tp 4:  ranks 0, 1 hold head 0; ranks 2, 3 hold head 1
    """
    if tp_size <= num_kv_heads:
        n = num_kv_heads // tp_size
        return n, tp_rank * n
    return 1, tp_rank * num_kv_heads // tp_size


def check_model_split(layout: ParallelLayout, model_config) -> None:
    """Clear errors for sizes the model cannot be split over (before any process starts)."""
    tp, pp, mc = layout.tp_size, layout.pp_size, model_config
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
    if mc.num_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {mc.num_heads} attention heads")
    if mc.num_kv_heads % tp and tp % mc.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and the model's {mc.num_kv_heads} KV heads: one must divide "
                         f"the other")
    if mc.vocab_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the vocabulary of {mc.vocab_size} tokens")
    if mc.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the MLP's {mc.intermediate_size} features")
    if pp > mc.num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is larger than the model's {mc.num_layers} layers")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_cpu_cores(ranks_on_node: int, allow_oversubscription: bool) -> None:
    cores = usable_cores()
    if ranks_on_node > cores and not allow_oversubscription:
        raise ValueError(f"{ranks_on_node} CPU ranks on this node but only {cores} cores: each rank needs a core "
                         f"(allow_cpu_oversubscription=True runs them anyway, slowly)")


def threads_per_rank(ranks_on_node: int) -> int:
    return max(1, usable_cores() // ranks_on_node)
