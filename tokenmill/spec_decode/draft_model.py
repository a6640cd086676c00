"""Draft-model proposals: a small model with the target's tokenizer drafts k tokens greedily.

The draft runs in the same engine, on the same block tables: its KV cache has the target's number of
blocks and block size, so block b holds the target's KV in one tensor and the draft's in another, and
every block-table operation (allocation, prefix hits, preemption, freeing) covers both at once.

The draft's KV is brought up to date only when it proposes, so a request at depth 0 costs nothing.
Each request remembers how far its draft KV is valid (`synced`); a proposal first runs the draft over
the verified tokens since then, ending with t, the token the target just added at position P, and
takes its first draft from that chunk's last row. The other k - 1 drafts are single-token steps:

    draft runs tokens[synced .. P] (t last; decode rows when short)  -> d1
               d1 at P+1 -> d2, ..., d_{k-1} at P+k-1 -> d_k            synced = P + 1

The scheduler reserves slots up to P+k-1 (lookahead, never hashed), so these writes stay inside the
request's own blocks; the target overwrites them when it runs those positions. All requests are
batched in every forward. Drafts are the draft model's argmax (a one-hot q), so verification couples
exactly (verify.py).
"""
from __future__ import annotations

import time

import torch

from tokenmill.device_copy import device_tensor, take_rows
from tokenmill.sample.sampler import argmax_rows
from tokenmill.sched.output import ScheduledRequest

CATCH_UP_DECODE_ROWS = 8  # the most rows a catch-up runs as decode rows (the CPU decode step's limit)


class DraftModelProposer:
    def __init__(self, model, kv_cache: torch.Tensor, backend):
        self.model = model
        self.kv_cache = kv_cache  # [draft layers, 2, num_blocks, block_size, draft kv heads, head_dim]
        self.kv_caches = [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
        self.backend = backend
        self.decode_step = None  # the draft's captured single-token steps: CUDA graphs, or the CPU's C step (builder)
        self._synced: dict[str, int] = {}  # request -> positions whose draft KV is valid
        # the last proposal's time spent catching up over runs longer than a verified one (new prompts, and
        # tokens skipped at depth 0): costs of admitting and of switching drafts back on, which the draft policy
        # tracks apart from drafting (adaptive.py)
        self.catch_up_seconds = 0.0

    def release(self, request_ids) -> None:
        """Finished or preempted (its blocks are gone): its draft KV starts again from position 0."""
        for rid in request_ids:
            self._synced.pop(rid, None)

    @torch.inference_mode()
    def propose_batch(self, runner, items: list[tuple[ScheduledRequest, object]]) -> dict[str, list[int]]:
        """items: (scheduled request, its worker state) for each request that sampled and may draft."""
        active = [(s.request_id, st, s.propose_k) for s, st in items if s.propose_k > 0]
        self.catch_up_seconds = 0.0
        if not active:
            return {}
        active.sort(key=lambda a: -a[2])  # deepest first: `_draft_in_one_call` runs its steps on a prefix
        pos = {rid: len(st.prompt_token_ids) + len(st.output_token_ids) - 1 for rid, st, _ in active}
        catch_up = [self._catch_up(rid, st, self._synced.get(rid, 0), pos[rid]) for rid, st, _ in active]
        ks = [k for _, _, k in active]
        drafts = self._draft_in_one_call(runner, catch_up, ks)
        if drafts is None:
            drafts = self._draft_step_by_step(runner, catch_up, ks)
        for rid, _, _ in active:
            self._synced[rid] = pos[rid] + 1
        return {rid: d for (rid, _, _), d in zip(active, drafts)}

    def _draft_step_by_step(self, runner, catch_up: list[ScheduledRequest], ks: list[int]) -> list[list[int]]:
        """The catch-up forward (its rows beyond a verified run's are timed as catch-up: new prompts, tokens
        skipped at depth 0), then one forward per further draft step, each request's last draft its input.
        The drafts stay on the device until the last step (each step's inputs are the step before's argmaxes,
        copied there), so on a GPU the host queues all k forwards and reads the drafts back once."""
        t0 = time.perf_counter()
        first = self._run(runner, catch_up)
        rows = [s.num_new_tokens for s in catch_up]
        long_rows = sum(n - 1 for n in rows if n > CATCH_UP_DECODE_ROWS)  # beyond each one's own last token
        if long_rows:  # the time is the device's: wait for it (new prompts and depth switches only, not per step)
            first.cpu()
            self.catch_up_seconds = (time.perf_counter() - t0) * long_rows / sum(rows)
        columns, last = [first], first
        for step in range(1, max(ks)):
            live = sum(k > step for k in ks)  # a prefix: the deepest come first (propose_batch)
            # the input token is a placeholder on the host: the step before's argmaxes fill it in on the device
            seqs = [ScheduledRequest(catch_up[j].request_id, catch_up[j].start_pos + catch_up[j].num_new_tokens - 1
                                     + step, 1, [], 1, draft_token_ids=[0]) for j in range(live)]
            last = self._run(runner, seqs, last[:live])
            columns.append(last)
        flat = torch.cat(columns).tolist()  # the one read back
        drafts, at = [[] for _ in ks], 0
        for col in columns:
            for j in range(len(col)):
                drafts[j].append(flat[at + j])
            at += len(col)
        return drafts

    def _draft_in_one_call(self, runner, catch_up: list[ScheduledRequest], ks: list[int]) -> list[list[int]] | None:
        """Every draft of every request in one C call (worker/cpu_decode_step.py `greedy`) when all catch-ups
        are decode rows that the captured step takes; None otherwise. Same forwards and argmaxes as
        `_draft_step_by_step`, without Python between the draft steps."""
        step = self.decode_step
        if not getattr(step, "runs_greedy_steps", False):  # only the CPU's C step has `greedy` (not CUDA graphs)
            return None
        if any(s.num_new_tokens > 1 and not s.draft_token_ids for s in catch_up):
            return None  # a long catch-up (a prompt) runs as a chunk, op by op
        input_ids, positions, batch, starts = runner.prepare_batch(catch_up)
        if not step.can_draft(batch, len(input_ids), len(catch_up)):
            return None
        return step.greedy(input_ids, positions, batch, [starts[j + 1] - 1 for j in range(len(catch_up))], ks)

    @staticmethod
    def _catch_up(rid: str, state, synced: int, pos: int) -> ScheduledRequest:
        """The draft's run over tokens synced .. pos. A short one (the usual: the accepted drafts and the
        target's token) is laid out as decode rows, like a verification (ModelRunner.prepare_batch): exact
        causal attention, and a shape the captured decode steps take; a long one (the prompt) as a chunk."""
        n = pos + 1 - synced
        if 1 < n <= CATCH_UP_DECODE_ROWS:
            return ScheduledRequest(rid, synced, n, [], 1, draft_token_ids=state.token_ids(synced + 1, pos + 1))
        return ScheduledRequest(rid, synced, n, [], 1)

    def _run(self, runner, seqs: list[ScheduledRequest], input_ids_from: torch.Tensor | None = None) -> torch.Tensor:
        """One draft forward over `seqs` (decode rows first, as the attention backend wants); the argmax at
        each one's last row, in the order given, on the device. `input_ids_from`: the single-token rows' input
        ids, already on the device (the host's are placeholders)."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].num_new_tokens != 1 and not seqs[i].draft_token_ids)
        ordered = [seqs[i] for i in order]
        input_ids, positions, batch, starts = runner.prepare_batch(ordered, stage_into=self.decode_step)
        if input_ids_from is not None:  # single-token rows only: `order` kept them in place
            input_ids.copy_(input_ids_from)
        step = self.decode_step
        if step is not None and step.can_run(batch, len(input_ids)):
            hidden = step.run(input_ids, positions, batch)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, self.backend.build_metadata(batch), self.backend)
        last = [starts[j + 1] - 1 for j in range(len(ordered))]
        tokens = argmax_rows(self.model.compute_logits(take_rows(hidden, last)))
        if order != sorted(order):  # back to the order given
            tokens = tokens.index_select(0, device_tensor(sorted(range(len(order)), key=order.__getitem__),
                                                          torch.int64, tokens.device))
        return tokens
