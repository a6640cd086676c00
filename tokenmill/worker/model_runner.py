"""Turns the scheduler's plain decision into tensors, runs the model, samples.

    scheduled seqs -> input_ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens
                   -> model -> hidden at sampling rows -> logits -> sampler -> token ids
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.eager_backend import EagerAttentionBackend
from tokenmill.attention.torch_backend import TorchAttentionBackend
from tokenmill.sample.sampler import SampleRow, Sampler, TokenLogprobs, batch_token_logprobs
from tokenmill.sched.output import ScheduledSeq, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # per request: logprob rows for the prompt tokens this chunk predicted (positions start+1 ..)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, seed: int = 0, attention_impl: str = "fused"):
        self.model = model
        self.block_size = block_size
        self.device = device
        # One tensor for the whole cache, per-layer views: [layers, k|v, blocks, block_size, kv_heads, head_dim]
        self.kv_cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        self.backend = EagerAttentionBackend() if attention_impl == "eager" else TorchAttentionBackend()
        self.sampler = Sampler(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.generators.pop(rid, None)

    def _generator(self, seq: ScheduledSeq) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        g = self.generators.get(seq.request_id)
        if g is None:
            # any 64-bit seed (n > 1 children use seed + i) maps onto the generator's unsigned range
            g = self.generators[seq.request_id] = torch.Generator().manual_seed(seed % 2**64)
        return g

    def prepare(self, seqs: list[ScheduledSeq]):
        bs = self.block_size
        n_tok = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(n_tok, out=qsl[1:])
        seq_lens = starts + n_tok
        max_blocks = max(len(s.block_ids) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_ids)] = s.block_ids
        seq_of_token = np.repeat(np.arange(len(seqs)), n_tok)
        positions = np.arange(qsl[-1]) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        input_ids = [t for s in seqs for t in s.token_ids]
        num_decodes = 0
        while num_decodes < len(seqs) and n_tok[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev, torch.int32),
            seq_lens=torch.from_numpy(seq_lens).to(dev, torch.int32),
            block_tables=torch.from_numpy(tables).to(dev, torch.int32),
            num_decodes=num_decodes,
            max_seq_len=int(seq_lens.max()),
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
            fresh_prefill=(starts == 0).tolist(),
        )
        self.backend.build_step_state(meta)
        return torch.tensor(input_ids, dtype=torch.int64, device=dev), torch.from_numpy(positions).to(dev), meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.forget(sched.finished_ids)
        # decodes first: the attention backend batches them as one group
        seqs = sorted(sched.seqs, key=lambda s: len(s.token_ids) != 1)
        input_ids, positions, meta = self.prepare(seqs)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        qsl = meta.query_start_loc_host
        out = ModelRunnerOutput()
        sample_idx = [i for i, s in enumerate(seqs) if s.sample]
        if sample_idx:
            logits = self.model.compute_logits(hidden[[qsl[i + 1] - 1 for i in sample_idx]])
            rows = [SampleRow(seqs[i].sampling_params, seqs[i].prompt_token_ids, seqs[i].output_token_ids,
                              self._generator(seqs[i])) for i in sample_idx]
            res = self.sampler(logits, rows)
            for j, i in enumerate(sample_idx):
                rid = seqs[i].request_id
                out.sampled[rid] = res.token_ids[j]
                if res.logprobs[j] is not None:
                    out.logprobs[rid] = res.logprobs[j]
        for i, s in enumerate(seqs):
            if s.want_prompt_logprobs:
                out.prompt_logprobs[s.request_id] = self._prompt_logprobs(s, hidden[qsl[i]:qsl[i + 1]])
        return out

    def _prompt_logprobs(self, seq: ScheduledSeq, hidden: torch.Tensor) -> list[TokenLogprobs]:
        """Position p's logits score prompt token p + 1; only positions inside the prompt count."""
        n_prompt = len(seq.prompt_token_ids)
        count = min(len(seq.token_ids), n_prompt - 1 - seq.start_pos)
        if count <= 0:
            return []
        lps = self.model.compute_logits(hidden[:count]).log_softmax(dim=-1)
        targets = torch.tensor(seq.prompt_token_ids[seq.start_pos + 1: seq.start_pos + 1 + count])
        return batch_token_logprobs(lps, targets, seq.sampling_params.prompt_logprobs)
