"""Draft-model proposals: a small model with the target's tokenizer drafts k tokens greedily.

The draft runs in the same engine, on the same block tables: its KV cache has the target's number of
blocks and block size, so block b holds the target's KV in one tensor and the draft's in another, and
every block-table operation (allocation, prefix hits, preemption, freeing) covers both at once.
To keep its KV in step, the draft model runs over every step's input tokens after the target does
(`forward`). Proposing then takes k single-token steps per request, all requests batched:

    accepted ... t  (t: the token the target added, at position P)
    draft feeds t at P -> d1, d1 at P+1 -> d2, ..., d_{k-1} at P+k-2 -> d_k

The scheduler reserves slots up to P+k-1 (lookahead, never hashed), so these writes stay inside the
request's own blocks; the target overwrites them when it runs those positions.
Drafts are the draft model's argmax (a one-hot q), so verification couples exactly (verify.py).
"""
from __future__ import annotations

import torch

from tokenmill.sched.output import ScheduledRequest


class DraftModelProposer:
    def __init__(self, model, kv_cache: torch.Tensor, backend):
        self.model = model
        self.kv_cache = kv_cache  # [draft layers, 2, num_blocks, block_size, draft kv heads, head_dim]
        self.kv_caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
        self.backend = backend

    def release(self, request_ids) -> None:
        pass

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> None:
        """Run the draft over the target's batch, writing its KV at the same slots."""
        self.backend.build_step_state(meta)
        self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def propose_batch(self, runner, items: list[tuple[ScheduledRequest, object]]) -> dict[str, list[int]]:
        """items: (scheduled request, its worker state) for each request that sampled and may draft."""
        active = [(s.request_id, st, s.propose_k) for s, st in items if s.propose_k > 0]
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in active}
        last = {rid: st.output_token_ids[-1] for rid, st, _ in active}
        pos = {rid: len(st.prompt_token_ids) + len(st.output_token_ids) - 1 for rid, st, _ in active}
        for step in range(max((k for _, _, k in active), default=0)):
            batch = [(rid, st) for rid, st, k in active if step < k]
            seqs = [ScheduledRequest(rid, pos[rid] + step, 1, [], 1, draft_token_ids=[last[rid]])
                    for rid, _ in batch]
            input_ids, positions, meta = runner.prepare(seqs, self.backend)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for (rid, _), t in zip(batch, tokens):
                drafts[rid].append(t)
                last[rid] = t
        return drafts
