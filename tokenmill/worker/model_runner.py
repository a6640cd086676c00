"""Turns the scheduler's plain decision into tensors, runs the model, samples.

    step diff -> request states (worker/request_state.py): tokens, block tables, generators
    scheduled requests -> input_ids, positions, slot_mapping, block_tables, query_start_loc, seq_lens
                   -> model -> hidden at sampling rows -> logits -> sampler -> token ids
    with drafts:   the last 1 + k rows -> logits -> verify (spec_decode/verify.py) -> accepted + 1 tokens
    then           proposer -> the next step's drafts (spec_decode/)

A pipeline stage (distributed/) runs only its own layers: the first embeds, the others receive the
previous stage's (hidden, residual) first, and all but the last send theirs on and return nothing. Only
the last stage samples and proposes.
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionBatch
from tokenmill.device_copy import PinnedRing, device_tensor, take_rows, to_device, to_pinned_host
from tokenmill.sample.sampler import (SampleRow, Sampler, TokenLogprobs, argmax_rows, token_logprob_rows,
                                      token_logprob_tensors)
from tokenmill.sched.output import ScheduledRequest, SchedulerOutput
from tokenmill.spec_decode.verify import DraftCheck, accept_greedy, verify
from tokenmill.worker.request_state import RequestState, RequestStates


@dataclass
class ModelRunnerOutput:
    """Per request that sampled: its new token ids (one today; several once speculation accepts drafts)
    and one logprobs row per token when it asked for them."""
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # to verify at the next step
    propose_seconds: float = 0.0  # time the proposer took this step (charged to its drafts by the draft policy)
    catch_up_seconds: float = 0.0  # the part of it spent catching a draft model up over long runs (new prompts, switches)
    # per request: logprob rows for the prompt tokens this chunk predicted (positions start+1 ..)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # async scheduling: tokens sampled on the device and still on their way back (ModelRunner.collect)
    deferred: "DeferredTokens | None" = None


@dataclass
class DeferredTokens:
    """One step's sampled tokens while they copy back to the host: `host` fills once `event` has passed.
    Request i's token is the placeholder at output_token_ids[slots[i]] of its state until then."""
    request_ids: list[str]
    states: list[RequestState]  # the states the placeholders are in (a reused id or a resumed request gets a new one)
    slots: list[int]
    tokens: torch.Tensor  # [n] on the device: the next step's inputs are filled in from it
    host: torch.Tensor
    event: object = None  # torch.cuda.Event; None on a CPU (the copy is done)
    rows: list = field(default_factory=list)  # SampleRows, for the logprobs where a row asked for them
    logprobs: tuple = ()  # sampler.logprob_tensors', copied back with the tokens
    prompt_logprobs: dict = field(default_factory=dict)  # request -> its rows' token_logprob_tensors, per chunk


# prompt logprobs take the logits of this many prompt rows at a time: a whole chunk's (2,048 rows of a 128K
# vocabulary: 1 GiB of float32, and as much again for its log_softmax) would be far past what the KV sizing's
# worst-case step measures (the logits of max_num_seqs rows, and one such slice of prompt logprobs)
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    def __init__(self, model, backend: AttentionBackend, num_blocks: int, block_size: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int = 0,
                 proposer=None, pipeline=None, hidden_size: int = 0):
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype, self.hidden_size = dtype, hidden_size
        self.pipeline = pipeline  # distributed/comm.py PipelineLink, None without pipeline parallelism
        shard = getattr(model, "shard", None)
        self.is_first_stage = shard is None or shard.is_first_stage
        self.is_last_stage = shard is None or shard.is_last_stage
        self.device = device
        self.backend = backend
        # One tensor for the whole cache, per-layer views: [layers, k|v, *backend layout]
        shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.zeros(num_layers, 2, *shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(num_layers)]
        self.sampler = Sampler(seed, device)
        self.requests = RequestStates(device)
        self.proposer = proposer  # spec_decode: propose_batch(runner, items) -> drafts, release(ids)
        self.encoder = None  # worker/encoder_runner.py EncoderRunner, for multimodal models
        # a captured decode step: DecodeGraphs (worker/cuda_graphs.py) on a GPU, CpuDecodeStep
        # (worker/cpu_decode_step.py) on a CPU; None runs every step through the model's per-op path
        self.decode_step = None
        self.grammars = None  # sample/grammar.py GrammarCompiler (worker/build.py): structured outputs' matchers
        self.num_bursts = 0  # steps run as bursts of decode steps (num_scheduler_steps; tests read it)
        self.num_argmax_steps = 0  # greedy decode / verification steps whose LM head and argmax ran in the C call
        # async scheduling (engine/core.py): sampled tokens stay on the device until collect(); per request
        # whose last token is one of them: that step, its row in the step's tokens, the placeholder's index
        self.defer_tokens = False
        self._pending: dict[str, tuple[DeferredTokens, int, int]] = {}  # (step, row, slot)
        self.num_deferred_steps = 0  # steps whose tokens stayed on the device until collect() (tests, gpu_check)
        self._token_ring = PinnedRing()  # deferred steps' tokens come back through it (CUDA only)
        self.num_pending_fills = [0, 0]  # steps whose pending inputs were filled by a slice / by a gather (tests)

    def release_requests(self, request_ids, preempted_ids=()) -> None:
        """Drop finished requests' state, and preempted ones' blocks and draft state (their tokens and seeded
        generators stay): when a step schedules nothing, which a step that preempts may."""
        self.requests.release(request_ids)
        self.requests.forget_blocks(preempted_ids)
        self._drop_pending(request_ids)
        if self.proposer is not None:
            self.proposer.release([*request_ids, *preempted_ids])

    def _drop_pending(self, request_ids) -> None:
        """Finished requests' placeholders: a step that failed after the next was launched is never collected,
        and its entries would stay (every later step would look them over)."""
        if self._pending:
            for rid in request_ids:
                self._pending.pop(rid, None)

    def prepare_batch(self, seqs: list[ScheduledRequest], states: list[RequestState] | None = None,
                      stage_into=None):
        """Returns (input_ids, positions, AttentionBatch, token_starts): token_starts[i] .. token_starts[i + 1]
        are seq i's rows in the flat token batch.

        Attention rows are not always sequences: a sequence verifying k drafts (which must come first,
        with the decodes) becomes 1 + k decode rows, one per query, each seeing the keys up to its own
        position. Its new keys are all written before attention runs, so that is exact causal attention,
        and it keeps verification on the batched decode kernel instead of the per-sequence prefill path:

            seq A: decode at 9           -> row A     seq_len 10
            seq B: verify at 4, 2 drafts -> rows B0, B1, B2   seq_lens 5, 6, 7   (B's block table each)
            seq C: prefill chunk         -> row C     seq_len start + n

        `stage_into`: a decode step that fits these CUDA graphs (the target's, or a draft model's) goes straight
        into their buffers (DecodeGraphs.host_rows, then commit).
        """
        if states is None:
            states = [self.requests[s.request_id] for s in seqs]
        if all(s.num_new_tokens == 1 or s.draft_token_ids for s in seqs):
            return self._prepare_decodes(seqs, states, stage_into)
        return self._prepare_mixed(seqs, states)

    def _prepare_mixed(self, seqs: list[ScheduledRequest], states: list[RequestState]):
        """prepare_batch for any step (prefill chunks among the rows), with numpy."""
        bs = self.block_size
        n_tok = np.fromiter((s.num_new_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(n_tok, out=qsl[1:])
        max_blocks = max(len(st.block_ids) for st in states)
        tables = self.requests.tables.gather([st.table_row for st in states], max_blocks)
        seq_of_token = np.repeat(np.arange(len(seqs)), n_tok)
        positions = np.arange(qsl[-1]) - qsl[:-1][seq_of_token] + starts[seq_of_token]
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = [t for s, st in zip(seqs, states)
                     for t in st.token_ids(s.start_pos, s.start_pos + s.num_new_tokens - len(s.draft_token_ids))
                     + s.draft_token_ids]
        num_dec_seqs = 0
        while num_dec_seqs < len(seqs) and (n_tok[num_dec_seqs] == 1 or seqs[num_dec_seqs].draft_token_ids):
            num_dec_seqs += 1
        nd = int(qsl[num_dec_seqs])  # decode rows: one per token of those sequences
        row_seq = np.concatenate([seq_of_token[:nd], np.arange(num_dec_seqs, len(seqs))])
        row_lens = np.concatenate([positions[:nd] + 1, (starts + n_tok)[num_dec_seqs:]])
        row_qsl = np.concatenate([np.arange(nd + 1), qsl[num_dec_seqs + 1:]])
        dev = partial(to_device, device=self.device)
        batch = AttentionBatch(
            slot_mapping=dev(torch.from_numpy(slots)),
            query_start_loc=dev(torch.from_numpy(row_qsl.astype(np.int32))),
            seq_lens=dev(torch.from_numpy(row_lens.astype(np.int32))),
            block_tables=dev(torch.from_numpy(tables[row_seq])),
            num_decodes=nd,
            max_seq_len=int(row_lens.max()),
            max_query_len=int(np.diff(row_qsl).max()),
            query_start_loc_host=row_qsl.tolist(),
            seq_lens_host=row_lens.tolist(),
        )
        return (dev(torch.tensor(input_ids, dtype=torch.int64)), dev(torch.from_numpy(positions)), batch,
                qsl.tolist())

    def _prepare_decodes(self, seqs: list[ScheduledRequest], states: list[RequestState], graphs=None):
        """prepare_batch for a step of decode rows only (plain decodes, verifications, a draft model's steps: the
        common steps), in plain lists: at batch 1 the general path's dozen numpy calls cost several times this.
        Sequence i's n_i tokens are rows at positions start_i .. start_i + n_i - 1, each with its own length."""
        bs, dev = self.block_size, self.device
        toks, pos, slots, lens, table_rows, qsl = [], [], [], [], [], [0]
        width = max(len(st.block_ids) for st in states)
        for s, st in zip(seqs, states):
            n, start, blocks = s.num_new_tokens, s.start_pos, st.block_ids
            if n == 1 and not s.draft_token_ids:  # a plain decode (most rows): its one token, without slicing
                prompt = st.prompt_token_ids
                toks.append(prompt[start] if start < len(prompt) else st.output_token_ids[start - len(prompt)])
            else:
                toks += st.token_ids(start, start + n - len(s.draft_token_ids)) + s.draft_token_ids
            for p in range(start, start + n):
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
                lens.append(p + 1)
                table_rows.append(st.table_row)
            qsl.append(qsl[-1] + n)
        rows = len(pos)
        # the block tables come from the persistent array in one gather (RequestStates.tables), the rest from
        # arrays, which torch and numpy wrap without a per-element conversion (4x cheaper than from lists).
        # A step the CUDA graphs will run goes into their host mirror and then the device in one copy;
        # otherwise two tensors (two copies to the device): the int64 rows and the int32 rows, cut into views
        longs = array("q", toks + pos + slots)
        tables = self.requests.tables.gather(table_rows, width)
        if graphs is not None and getattr(graphs, "can_stage", None) and graphs.can_stage(rows, width):
            host_longs, host_lens, host_tables = graphs.host_rows(rows)
            host_longs[:, :rows] = np.frombuffer(longs, dtype=np.int64).reshape(3, rows)
            host_lens[:rows] = lens
            host_tables[:rows, :width] = tables
            ids, positions, slot_mapping, qsl_t, seq_lens, block_tables = graphs.commit(rows, width)
        else:
            longs = torch.frombuffer(longs, dtype=torch.int64)
            ints = np.empty(2 * rows + 1 + rows * width, dtype=np.int32)
            ints[:rows + 1] = range(rows + 1)
            ints[rows + 1:2 * rows + 1] = lens
            ints[2 * rows + 1:].reshape(rows, width)[:] = tables
            longs, ints = to_device(longs, dev), to_device(torch.from_numpy(ints), dev)
            ids, positions, slot_mapping = longs[:rows], longs[rows:2 * rows], longs[2 * rows:]
            qsl_t, seq_lens = ints[:rows + 1], ints[rows + 1:2 * rows + 1]
            block_tables = ints[2 * rows + 1:].view(rows, width)
        batch = AttentionBatch(
            slot_mapping=slot_mapping, query_start_loc=qsl_t, seq_lens=seq_lens, block_tables=block_tables,
            num_decodes=rows, max_seq_len=max(lens), max_query_len=1, query_start_loc_host=list(range(rows + 1)),
            seq_lens_host=lens)
        return ids, positions, batch, qsl

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.proposer is not None:
            self.proposer.release(sched.finished_ids + sched.preempted_ids)
        self.requests.apply(sched)
        self._drop_pending(sched.finished_ids)
        if self._pending:  # a request installed anew (resumed, or a reused id) has its tokens in its new state
            for s in sched.seqs:
                if s.new_request is not None:
                    self._pending.pop(s.request_id, None)
        # decodes (and verifications, as decode rows) first: the attention backend batches them as one group
        seqs = sorted(sched.seqs, key=lambda s: s.num_new_tokens != 1 and not s.draft_token_ids)
        bursting = any(s.num_steps > 1 for s in seqs)
        if bursting:
            seqs.sort(key=lambda s: -s.num_steps)
        states = [self.requests[s.request_id] for s in seqs]
        input_ids, positions, batch, qsl = self.prepare_batch(seqs, states, None if bursting else self.decode_step)
        if self._pending:
            self._fill_pending(seqs, states, input_ids, qsl)
        if bursting:
            burst = self._run_burst(seqs, input_ids, positions, batch)
            if burst is not None:
                return burst
        elif self._argmax_rows(seqs):
            out = self._run_argmax_rows(seqs, input_ids, positions, batch)
            if out is not None:
                return out
        intermediate = None
        if not self.is_first_stage:
            intermediate = self.pipeline.recv(len(positions), self.hidden_size, self.dtype, self.device)
        embeds = self._multimodal_embeds(sched, seqs, input_ids, qsl) if self.encoder is not None else None
        step = self.decode_step
        if step is not None and intermediate is None and step.can_run(batch, len(input_ids)):
            hidden = step.run(input_ids, positions, batch)  # never built for multimodal models
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, self.backend.build_metadata(batch), self.backend,
                                intermediate, embeds)
        out = ModelRunnerOutput()
        if not self.is_last_stage:
            self.pipeline.send(*hidden)
            return out
        plain = [i for i, s in enumerate(seqs) if s.num_sampled_positions and not s.draft_token_ids]
        if plain:
            self._sample(out, [seqs[i] for i in plain], [states[i] for i in plain],
                         take_rows(hidden, [qsl[i + 1] - 1 for i in plain]))
        drafted = [i for i, s in enumerate(seqs) if s.draft_token_ids]
        if drafted:
            rows = [r for i in drafted for r in range(qsl[i + 1] - seqs[i].num_sampled_positions, qsl[i + 1])]
            self._verify(out, [seqs[i] for i in drafted], take_rows(hidden, rows))
        if self.proposer is not None:
            self._propose(out, seqs)
        if any(s.wants_prompt_logprobs for s in seqs):
            self._prompt_logprobs(out, seqs, states, hidden, qsl)
        return out

    def _fill_pending(self, seqs: list[ScheduledRequest], states: list[RequestState], input_ids: torch.Tensor,
                      qsl: list[int]) -> None:
        """Async scheduling: inputs that are tokens the step before sampled and has not sent back yet (the
        placeholders in the states) are copied in on the device, from that step's token tensor."""
        by_step: dict[int, tuple[DeferredTokens, list[int], list[int]]] = {}  # id(step) -> its rows, its sources
        pending_of = self._pending
        for i, (s, st) in enumerate(zip(seqs, states)):
            pending = pending_of.get(s.request_id)
            if pending is None:
                continue
            step, src, slot = pending
            pos = len(st.prompt_token_ids) + slot  # the placeholder's position
            if s.start_pos <= pos < s.start_pos + s.num_new_tokens - len(s.draft_token_ids):
                _, rows, srcs = by_step.setdefault(id(step), (step, [], []))
                rows.append(qsl[i] + pos - s.start_pos)
                srcs.append(src)
        for step, rows, srcs in by_step.values():  # one step's, in practice: the one just before
            n = len(rows)
            # the same requests in the same order (rows only ever increase): a slice
            if rows[-1] - rows[0] == n - 1 and srcs == list(range(srcs[0], srcs[0] + n)):
                input_ids[rows[0]:rows[0] + n].copy_(step.tokens[srcs[0]:srcs[0] + n])
                self.num_pending_fills[0] += 1
                continue
            self.num_pending_fills[1] += 1
            idx = to_device(torch.tensor(rows + srcs, dtype=torch.int64), input_ids.device)
            input_ids[idx[:n]] = step.tokens[idx[n:]]

    def collect(self, deferred: DeferredTokens, out: ModelRunnerOutput) -> None:
        """A deferred step's tokens, once on the host, into its output (and their logprobs, where asked):
        they replace the placeholders in the states of the requests still there."""
        if deferred.event is not None:
            deferred.event.synchronize()
        for rid, chunks in deferred.prompt_logprobs.items():
            out.prompt_logprobs[rid] = [row for c in chunks for row in token_logprob_rows(*c)]
        tokens = deferred.host.tolist()
        if deferred.logprobs:
            for rid, lp in zip(deferred.request_ids, self.sampler.logprob_rows(deferred.rows, deferred.logprobs)):
                if lp is not None:
                    out.logprobs[rid] = [lp]
        for rid, st, slot, tok in zip(deferred.request_ids, deferred.states, deferred.slots, tokens):
            out.sampled_token_ids[rid] = [tok]
            st.output_token_ids[slot] = tok  # harmless where the state was dropped or replaced since
            pending = self._pending.get(rid)
            if pending is not None and pending[0] is deferred:  # not overridden by a later step's
                del self._pending[rid]

    def _argmax_rows(self, seqs: list[ScheduledRequest]) -> bool:
        """Whether every sequence is a decode or a verification of drafts whose sampler would be an argmax of
        each row's raw logits (greedy; no logprobs, penalties or pending min_tokens): the one-call step can then
        also run the LM head and the argmax on every row, which saves the logits' round trip through torch and
        the sampler."""
        if (not getattr(self.decode_step, "runs_greedy_steps", False)  # the CPU step with the head's C kernels
                or self.encoder is not None or self.pipeline is not None):
            return False
        states = self.requests
        return all(s.num_new_tokens == s.num_sampled_positions == 1 + len(s.draft_token_ids)
                   and not s.wants_prompt_logprobs and states[s.request_id].takes_argmax() for s in seqs)

    def _run_argmax_rows(self, seqs: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                         batch) -> ModelRunnerOutput | None:
        """`_argmax_rows` steps in one C call (a greedy step of one per row, `CpuDecodeStep.greedy`); each
        verification then accepts its drafts by the greedy rule (spec_decode/verify.py `accept_greedy`;
        placeholder drafts keep the first row's token only). None where the call cannot take the
        rows: the step then runs as a plain one."""
        step, rows = self.decode_step, len(input_ids)
        if not step.can_draft(batch, rows, rows):
            return None
        tokens = step.greedy(input_ids, positions, batch, list(range(rows)), [1] * rows)
        self.num_argmax_steps += 1
        out, row = ModelRunnerOutput(), 0
        for s in seqs:
            kept = accept_greedy([t for t, in tokens[row:row + s.num_new_tokens]],
                                 [] if s.draft_placeholders else s.draft_token_ids)
            row += s.num_new_tokens
            self.requests[s.request_id].output_token_ids.extend(kept)
            out.sampled_token_ids[s.request_id] = kept
        if self.proposer is not None:
            self._propose(out, seqs)
        return out

    def _run_burst(self, seqs: list[ScheduledRequest], input_ids: torch.Tensor, positions: torch.Tensor,
                   batch) -> ModelRunnerOutput | None:
        """num_scheduler_steps: every sequence is a greedy decode row (the scheduler checked), ordered by steps,
        most first; all of their steps in one C call, each argmax the next step's input: the tokens a plain
        step's logits and argmax would give, step after step. None where the one-call step cannot take the
        batch: it then runs as a plain step, and the scheduler counts the one token each gets."""
        step = self.decode_step
        if step is None or not step.can_draft(batch, len(input_ids), len(seqs)):
            return None
        stops = [self.requests[s.request_id].sampling_params.stop_ids for s in seqs]
        tokens = step.greedy(input_ids, positions, batch, list(range(len(seqs))), [s.num_steps for s in seqs],
                             stops if any(stops) else None)
        self.num_bursts += 1
        out = ModelRunnerOutput()
        for s, toks in zip(seqs, tokens):
            self.requests[s.request_id].output_token_ids.extend(toks)
            out.sampled_token_ids[s.request_id] = toks
        return out

    def _multimodal_embeds(self, sched: SchedulerOutput, seqs: list[ScheduledRequest], input_ids: torch.Tensor,
                           qsl: list[int]) -> torch.Tensor | None:
        """Encode what the step needs (and queue the prefetches), then splice image rows into the embeddings;
        None when no sequence in the step touches an image's placeholders."""
        enc = self.encoder
        enc.apply(sched)
        states = [self.requests[s.request_id] for s in seqs]
        spans = [(qsl[i], s.start_pos, s.num_new_tokens - len(s.draft_token_ids), st.mm_items)
                 for i, (s, st) in enumerate(zip(seqs, states))
                 if st.mm_items and s.start_pos < st.mm_items[-1].end]
        return enc.inputs_embeds(input_ids, spans) if spans else None

    def _sample(self, out: ModelRunnerOutput, seqs: list[ScheduledRequest], states: list[RequestState],
                hidden: torch.Tensor) -> None:
        """One token per sequence from its last position's hidden state; appended to the worker's state."""
        logits = self.model.compute_logits(hidden)
        if all(st.takes_argmax() for st in states):  # the common greedy batch: the argmax is the whole sampler
            tokens = argmax_rows(logits)
            if self.defer_tokens:
                self._sample_deferred(out, seqs, states, tokens, [], ())
                return
            for s, st, tok in zip(seqs, states, tokens.tolist()):
                st.output_token_ids.append(tok)
                out.sampled_token_ids[s.request_id] = [tok]
            return
        rows = [SampleRow(st.sampling_params, st.prompt_token_ids, st.output_token_ids,
                          self.requests.generator(s.request_id)) for s, st in zip(seqs, states)]
        if any(st.structured for st in states):
            self._grammar_masks(seqs, states, rows)
        if self._pending:
            self._pending_penalty_tokens(seqs, rows)
        if self.defer_tokens:
            tokens = self.sampler.sample(logits, rows)
            self._sample_deferred(out, seqs, states, tokens, rows, self.sampler.logprob_tensors(logits, tokens, rows))
            return
        res = self.sampler(logits, rows)
        for j, (s, st) in enumerate(zip(seqs, states)):
            st.output_token_ids.append(res.token_ids[j])
            out.sampled_token_ids[s.request_id] = [res.token_ids[j]]
            if res.logprobs[j] is not None:
                out.logprobs[s.request_id] = [res.logprobs[j]]

    def _grammar_masks(self, seqs: list[ScheduledRequest], states: list[RequestState], rows: list[SampleRow]) -> None:
        """Structured outputs: each such row's allowed next tokens, from its matcher once it has taken the tokens
        sampled since its last step. Under async scheduling the last of them may still be on the device: it is
        read there (the one wait such a request costs a step; requests without a grammar never pay it)."""
        for s, st, row in zip(seqs, states, rows):
            if not st.structured:
                continue
            tokens = st.output_token_ids
            pending = self._pending.get(s.request_id)
            if pending is not None and pending[2] < len(tokens):
                step, src, slot = pending
                tokens = tokens[:slot] + [int(step.tokens[src])] + tokens[slot + 1:]
            grammar = self._grammar(st)
            row.token_bitmask = mask = grammar.next_bitmask(tokens)
            row.grammar_complete = mask is not None and grammar.only_stops(mask)

    def _grammar(self, st: RequestState):
        """The request's matcher (sample/grammar.py), made at its first step that samples."""
        if st.grammar is None:
            if self.grammars is None:
                raise RuntimeError("this model runner was built without a grammar compiler (worker/build.py)")
            # the grammar's stops are EOS alone (vLLM's): a stop token id that is also text stays text to it
            sp = st.sampling_params
            st.grammar = self.grammars.matcher(sp.structured_outputs, list(sp.eos_token_ids))
        return st.grammar

    def _pending_penalty_tokens(self, seqs: list[ScheduledRequest], rows: list[SampleRow]) -> None:
        """Async scheduling: a request whose sampler reads its output (penalties, bad words of several tokens) and
        that ran ahead samples while its last token is a placeholder (the step before has not sent it back): its
        row takes that token from the device instead."""
        for s, row in zip(seqs, rows):
            pending = self._pending.get(s.request_id)
            if pending is not None and row.params.reads_output:
                step, src, slot = pending
                ids = row.output_token_ids
                # the placeholder is the last token (a request runs ahead of one step only): anything else would
                # drop a real token from the penalties, silently
                assert slot == len(ids) - 1, (s.request_id, slot, len(ids))
                row.output_token_ids = ids[:slot]
                row.pending = step.tokens[src:src + 1]

    def _sample_deferred(self, out: ModelRunnerOutput, seqs: list[ScheduledRequest], states: list[RequestState],
                         tokens: torch.Tensor, rows: list[SampleRow], logprobs: tuple) -> None:
        """Async scheduling: the tokens (and logprobs) start their copy to the host and the states get
        placeholders; the engine collects them after it has launched the next step."""
        self.num_deferred_steps += 1
        if tokens.is_cuda:
            host = self._token_ring.copy(tokens)
            logprobs = tuple(to_pinned_host(t) for t in logprobs)
            event = torch.cuda.Event()
            event.record()  # after every copy: collect() waits for this, never for a later step's work
        else:
            host, event = tokens, None
        slots = []
        for s, st in zip(seqs, states):
            slots.append(len(st.output_token_ids))
            st.output_token_ids.append(0)  # placeholder: its id arrives in collect()
        ids = [s.request_id for s in seqs]
        deferred = DeferredTokens(ids, states, slots, tokens, host, event, rows, logprobs)
        # the previous deferred step's requests keep their entries until it is collected; this step's override
        self._pending.update((rid, (deferred, j, slot)) for j, (rid, slot) in enumerate(zip(ids, slots)))
        out.deferred = deferred

    def _verify(self, out: ModelRunnerOutput, seqs: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Drafts against the target's logits at their k + 1 rows; the accepted tokens are appended.
        Placeholder drafts (adaptive speculation pricing a depth) ran through the model like drafts, but only
        their first row is sampled, as a plain step would: the same token and the same generator draws."""
        states = [self.requests[s.request_id] for s in seqs]
        checks = [DraftCheck(SampleRow(st.sampling_params, st.prompt_token_ids, st.output_token_ids,
                                       self.requests.generator(s.request_id)),
                             [] if s.draft_placeholders else s.draft_token_ids)
                  for s, st in zip(seqs, states)]
        for c, st in zip(checks, states):
            if st.structured:  # a mask per row, each after the drafts before it
                c.grammar_rows = self._grammar(st).draft_bitmasks(st.output_token_ids, c.drafts)
        logits = self.model.compute_logits(hidden)
        if any(s.draft_placeholders for s in seqs):
            keep, row = [], 0
            for s in seqs:
                n = 1 + len(s.draft_token_ids)
                keep.extend(range(row, row + (1 if s.draft_placeholders else n)))
                row += n
            logits = take_rows(logits, keep)
        tokens, logprobs = verify(self.sampler, logits, checks)
        for s, st, toks, lps in zip(seqs, states, tokens, logprobs):
            st.output_token_ids.extend(toks)
            out.sampled_token_ids[s.request_id] = toks
            if lps is not None:
                out.logprobs[s.request_id] = lps

    def _propose(self, out: ModelRunnerOutput, seqs: list[ScheduledRequest]) -> None:
        items = [(s, self.requests[s.request_id]) for s in seqs
                 if s.propose_k and s.request_id in out.sampled_token_ids]
        if items:
            t0 = time.perf_counter()
            drafts = self.proposer.propose_batch(self, items)
            for rid, d in drafts.items():
                st = self.requests[rid]
                if st.structured:  # cut at the first token its grammar refuses: it could never be accepted
                    drafts[rid] = self._grammar(st).valid_drafts(st.output_token_ids, d)
            out.draft_token_ids.update((rid, d) for rid, d in drafts.items() if d)
            out.propose_seconds = time.perf_counter() - t0
            out.catch_up_seconds = getattr(self.proposer, "catch_up_seconds", 0.0)

    def _prompt_logprobs(self, out: ModelRunnerOutput, seqs: list[ScheduledRequest], states: list[RequestState],
                         hidden: torch.Tensor, qsl: list[int]) -> None:
        """The prompt logprob rows of the sequences that want them, into `out`; in a step whose tokens are
        deferred (async scheduling), into the deferred step, so that they come back with its tokens: reading
        them here would make the host wait for the step it has just launched."""
        deferred = out.deferred
        for i, s in enumerate(seqs):
            if not s.wants_prompt_logprobs:
                continue
            chunks = self._prompt_logprob_tensors(s, states[i], hidden[qsl[i]:qsl[i + 1]])
            if deferred is None:
                out.prompt_logprobs[s.request_id] = [row for c in chunks for row in token_logprob_rows(*c)]
            elif deferred.event is not None:
                deferred.prompt_logprobs[s.request_id] = [tuple(to_pinned_host(t) for t in c) for c in chunks]
            else:
                deferred.prompt_logprobs[s.request_id] = chunks
        if deferred is not None and deferred.event is not None and deferred.prompt_logprobs:
            deferred.event = torch.cuda.Event()  # after these copies too (the stream orders the tokens' before)
            deferred.event.record()

    def _prompt_logprob_tensors(self, seq: ScheduledRequest, state: RequestState, hidden: torch.Tensor) -> list:
        """Position p's logits score prompt token p + 1; only positions inside the prompt count. Per chunk of
        PROMPT_LOGPROB_ROWS rows: token_logprob_tensors, on the device."""
        prompt = state.prompt_token_ids
        count = min(seq.num_new_tokens, len(prompt) - 1 - seq.start_pos)
        chunks = []
        for lo in range(0, max(count, 0), PROMPT_LOGPROB_ROWS):
            hi = min(count, lo + PROMPT_LOGPROB_ROWS)
            lps = self.model.compute_logits(hidden[lo:hi]).log_softmax(dim=-1)
            targets = device_tensor(prompt[seq.start_pos + 1 + lo: seq.start_pos + 1 + hi], torch.int64, lps.device)
            chunks.append(token_logprob_tensors(lps, targets, state.sampling_params.prompt_logprobs))
        return chunks
