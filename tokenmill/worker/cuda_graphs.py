"""CUDA graphs for decode steps (and speculative verification rows, which are decode rows too).

A decode step's forward is hundreds of small kernel launches; on a GPU the launch overhead alone can
exceed the math at small batch. So each batch-size bucket's forward is captured once at startup and
replayed. A step of n rows runs in the smallest bucket >= n:

    buckets   1, 2, 4, 8, 16, 24, 32, ... (steps of 8) up to max_num_seqs
    buffers   one int32 buffer on the device, and its mirrors in pinned host memory:

              | longs [3, B] int64              | seq_lens [B] | block_tables [B, M]              |
              | input_ids | positions | slots   |              | row 0 | row 1 | .. | row B-1     |
              '----------- one copy: everything up to row n-1 of the tables ------------'
              query_start_loc [B+1] (constant: 0, 1, .., B) lives apart
              (B = the largest bucket, M = max blocks per sequence; bucket b reads rows [:b])

    rows      0 .. n-1: this step's        n .. b-1: padding
    padding   slot_mapping -1 (writes nothing), seq_len 1, token 0, position 0, and a table row that holds
              block ids (zeros, or an earlier step's): they attend to one cached key of a real block and their
              hidden rows are never read

Inputs live in the persistent buffers. The runner stages a decode step's host rows straight into a pinned
mirror (`host_rows`, then `commit`), and one copy to the device moves the longs, the lengths and the step's
table rows together; a step prepared elsewhere is copied in piece by piece (`run`). The mirrors are a ring:
the host fills the next one while a copy from the last may still be queued (an event says when a mirror is
free again: under async scheduling a target's step always finds it so; a draft model's graphs have k + 1
mirrors, so that its k chained steps of one proposal never wait there). Columns past a
row's blocks keep what they held; kernels read a row only up to its sequence length. Padding rows that an
earlier, larger step left are reset before the replay (in the mirror, for a staged step). The logits are
computed outside the graph, from the rows that sample. The attention backend's launch plan is fixed at
capture, so the graph is captured with max_seq_len = the longest a sequence can be (split-KV sized for the
worst case; the kernel reads the real lengths from seq_lens). Only backends whose `cuda_graph_safe`
is True (no host loops over the batch: the buffers' host lists are placeholders) are captured; the
torch backend is not.

A draft model (speculative decoding) gets graphs of its own, over its model and KV cache: its single-token
draft steps are staged into its own mirrors and replay them as the target's decode steps do.

`capture=False` runs the same padded buffers eagerly: the CPU tests use it to check the padding rules.
"""
from __future__ import annotations

import logging
import time

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionBatch
from tokenmill.kv.manager import cdiv

logger = logging.getLogger("tokenmill")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))[1:]
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


MIRRORS = 3  # host mirrors of the input buffers in the ring


class _Mirror:
    """One pinned host copy of a DecodeGraphs' input buffer, with numpy views of its layout."""

    def __init__(self, graphs: "DecodeGraphs"):
        cuda = graphs.raw.is_cuda
        self.raw = torch.zeros(graphs.raw.shape, dtype=torch.int32, pin_memory=cuda)
        longs, lens, tables = graphs._layout(self.raw)
        longs[2].fill_(-1)
        lens.fill_(1)
        self.longs, self.seq_lens, self.block_tables = longs.numpy(), lens.numpy(), tables.numpy()
        self.event = torch.cuda.Event() if cuda else None  # after the last copy out of this mirror
        self.filled = 0  # rows [0, filled) may hold an earlier step's real rows


class DecodeGraphs:
    def __init__(self, model, backend: AttentionBackend, kv_caches, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: str, capture: bool = True, mirrors: int = MIRRORS):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_rows = self.sizes[-1]  # decode rows a replay takes (speculation's draft policy stays within it)
        self.max_model_len, self.block_size, self.device = max_model_len, block_size, device
        self.max_blocks = cdiv(max_model_len, block_size)
        b, m = self.max_rows, self.max_blocks
        i32 = dict(dtype=torch.int32, device=device)
        self.raw = torch.zeros(self._head_ints + b * m, **i32)
        self.longs, self.seq_lens, self.block_tables = self._layout(self.raw)
        self.input_ids, self.positions, self.slot_mapping = self.longs.unbind(0)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(b + 1, **i32)
        # host mirrors: a ring, so that filling one never waits for the copy queued from the last
        self._mirrors = [_Mirror(self) for _ in range(mirrors if self.raw.is_cuda else 1)]
        self._next_mirror = 0
        self.filled = 0  # rows [0, filled) may hold an earlier step's real rows; the rest are padding
        self._staging: _Mirror | None = None  # the mirror host_rows gave out, until commit
        self._staged: tuple = (None, None)  # (rows, width) of the last staged step, and its views of the buffers
        self.num_staged_steps = 0  # replays whose rows were staged in place (tests)
        self.num_runs = 0  # steps run through the buckets (tests, gpu_check)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.use_graphs = capture  # False: the padded buffers run eagerly (CPU tests)
        self.enabled = True  # False once capture has given up: every step then runs the plain path
        if capture:
            self._capture_all()

    @property
    def _head_ints(self) -> int:
        return 7 * self.max_rows  # the longs (3 rows of int64) and seq_lens, in int32 units

    def _layout(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`raw`'s views: longs [3, B] int64, seq_lens [B], block_tables [B, M] (the diagram above)."""
        b = self.max_rows
        return (raw[:6 * b].view(torch.int64).view(3, b), raw[6 * b:7 * b],
                raw[7 * b:].view(b, self.max_blocks))

    def _batch(self, size: int) -> AttentionBatch:
        """The attention batch of bucket `size`, over the persistent buffers (host ints: the worst case)."""
        return AttentionBatch(self.slot_mapping[:size], self.query_start_loc[:size + 1], self.seq_lens[:size],
                              self.block_tables[:size], num_decodes=size, max_seq_len=self.max_model_len,
                              max_query_len=1, query_start_loc_host=list(range(size + 1)), seq_lens_host=[1] * size)

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.backend.build_metadata(self._batch(size))
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool, t0, reserved = None, time.perf_counter(), torch.cuda.memory_reserved()
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self._warm_up(size)
            torch.cuda.synchronize()
            if not self.backend.cuda_graph_safe:  # e.g. the Triton kernels failed and it fell back
                logger.warning("attention backend %s cannot be captured; decode steps run eagerly",
                               type(self.backend).__name__)
                self.graphs.clear()
                self.enabled = False
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        # the graphs' pool stays reserved beside the KV cache (outside the profiled budget: about one decode step
        # of max_num_seqs rows, small against the prefill peak the budget holds back)
        logger.info("CUDA graphs captured for decode batch sizes %s in %.1f s, %.2f GiB", self.sizes,
                    time.perf_counter() - t0, (torch.cuda.memory_reserved() - reserved) / 2**30)

    def _warm_up(self, size: int) -> None:
        """Bucket `size` run once outside the graph (Triton compiles, lazy buffers allocate), its rows writing
        real slots (0, 1, .. within the cache) rather than -1: if a Triton kernel fails here, the torch fallback
        redoes the layer, and its write_kv takes no -1 (an index error on a CPU, a device-side assert that ends
        the CUDA context on a GPU). Capture runs at startup, when nothing is cached, so what the rows write is
        never read; the slots the buffer held before are put back (-1 at startup)."""
        saved = self.slot_mapping[:size].clone()
        num_slots = self.kv_caches[0][0].shape[0] * self.block_size
        self.slot_mapping[:size].copy_(torch.arange(size, device=saved.device) % num_slots)
        try:
            self._forward(size)
        finally:
            self.slot_mapping[:size].copy_(saved)

    def can_run(self, batch: AttentionBatch, num_tokens: int) -> bool:
        """Decode rows only (one query each), within the largest bucket and the buffers' table width."""
        return (self.enabled and batch.num_decodes == batch.num_seqs == num_tokens and num_tokens <= self.max_rows
                and batch.block_tables.shape[1] <= self.max_blocks)

    def can_stage(self, rows: int, width: int) -> bool:
        """Whether a decode step of `rows` rows and `width` block-table columns runs in a bucket (can_run)."""
        return self.enabled and rows <= self.max_rows and width <= self.max_blocks

    def host_rows(self, rows: int) -> tuple:
        """The next host mirror for a decode step of `rows` rows, as numpy views (longs [3, B], seq_lens [B],
        block_tables [B, M]), its padding already right past `rows`: the runner writes the step's rows
        [:rows] (tables: each row's blocks; later columns may keep stale ids) and then calls `commit`."""
        mirror = self._mirrors[self._next_mirror]
        self._next_mirror = (self._next_mirror + 1) % len(self._mirrors)
        if mirror.event is not None:
            mirror.event.synchronize()  # done already unless the host is a whole ring ahead of the device
        if mirror.filled > rows:  # an earlier, larger step's rows: padding again
            longs, lens = mirror.longs, mirror.seq_lens
            longs[:2, rows:mirror.filled] = 0
            longs[2, rows:mirror.filled] = -1
            lens[rows:mirror.filled] = 1
        mirror.filled = rows
        self._staging = mirror
        return mirror.longs, mirror.seq_lens, mirror.block_tables

    def commit(self, rows: int, width: int) -> tuple[torch.Tensor, ...]:
        """The mirror `host_rows` gave, to the device in one copy (up to row rows-1's `width` columns of the
        tables). Returns the step's input_ids, positions, slot_mapping, query_start_loc, seq_lens and
        block_tables: views of the buffers, which `run` then finds in place."""
        mirror, self._staging = self._staging, None
        # the table rows go whole (M ints each, as vLLM copies its block table): 8 KB a row at 32K tokens
        end = self._head_ints + (rows - 1) * self.max_blocks + width
        self.raw[:end].copy_(mirror.raw[:end], non_blocking=True)
        if mirror.event is not None:
            mirror.event.record()
        self.filled = rows  # the copy wrote the padding of every bucket up to B
        key, views = self._staged
        if key != (rows, width):  # steady decoding keeps its shape for many steps: its views are made once
            views = (self.input_ids[:rows], self.positions[:rows], self.slot_mapping[:rows],
                     self.query_start_loc[:rows + 1], self.seq_lens[:rows], self.block_tables[:rows, :width])
            self._staged = ((rows, width), views)
        return views

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """This step's rows into the buffers (unless staged there), padding rows reset, replay; the step's
        hidden rows [n, H]. Called inside ModelRunner.execute's inference mode (entering it again costs ~5 us)."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.num_runs += 1
        if input_ids.data_ptr() == self.input_ids.data_ptr():  # staged in place
            self.num_staged_steps += 1
        else:
            self.input_ids[:n].copy_(input_ids)
            self.positions[:n].copy_(positions)
            self.slot_mapping[:n].copy_(batch.slot_mapping)
            self.seq_lens[:n].copy_(batch.seq_lens)
            width = batch.block_tables.shape[1]
            self.block_tables[:n, :width].copy_(batch.block_tables)
        stale = min(size, self.filled)
        if stale > n:  # an earlier, larger step left real rows in this bucket's padding: reset only those
            self.longs[:2, n:stale].zero_()
            self.slot_mapping[n:stale].fill_(-1)
            self.seq_lens[n:stale].fill_(1)
            self.block_tables[n:stale].zero_()
        self.filled = max(n, self.filled) if self.filled > size else n
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
