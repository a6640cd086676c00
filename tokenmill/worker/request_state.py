"""What the worker remembers about each request between steps (vLLM v1's CachedRequestState), so that the
scheduler's per-step output can stay a small diff of plain data (sched/output.py):

    NewRequestData      -> RequestState(prompt, output so far, params, whole block table)
    ScheduledRequest    -> block_ids += new_block_ids; input tokens = tokens[start_pos : start_pos + n]
    tokens it samples   -> output_token_ids += sampled
    new_output_token_ids -> output_token_ids[output_start:] = them (pipeline stages that do not sample)
    preempted_ids       -> block_ids = []  (tokens and the seeded generator stay: it resumes where it was)
    finished_ids        -> state and generator dropped

Each block table is also a row of one numpy array (BlockTables), written only where blocks change, so that a
step gathers its rows in one call rather than rebuilding M ints per row from lists.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.engine.request import token_range
from tokenmill.sampling_params import SamplingParams
from tokenmill.sched.output import NewRequestData, SchedulerOutput


@dataclass
class RequestState:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    mm_items: list = field(default_factory=list)  # multimodal/inputs.py MultiModalItem, in prompt order
    grammar: object = None  # sample/grammar.py RequestGrammar, made at the first step that samples (structured outputs)
    table_row: int = -1  # its row of RequestStates.tables

    def __post_init__(self):
        self.argmax_only = self.sampling_params.argmax_only  # read every step: looked up once
        self.structured = self.sampling_params.structured_outputs is not None

    def takes_argmax(self) -> bool:
        return self.argmax_only and len(self.output_token_ids) >= self.sampling_params.min_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        return token_range(self.prompt_token_ids, self.output_token_ids, start, end)


class BlockTables:
    """Every request's block table as a row of one int32 array, kept equal to its `block_ids`:

        row r | b0 b1 .. b(n-1) | 0 .. 0 |     n = len(block_ids); zeros past it
              0                 n        width (doubles when a table outgrows it; rows double likewise)

    Writes touch only the blocks a step adds (or a preemption clears); `gather` gives a step's rows at once."""

    def __init__(self, rows: int = 16, width: int = 16):
        self.array = np.zeros((rows, width), dtype=np.int32)
        self._free = list(range(rows - 1, -1, -1))

    def new_row(self) -> int:
        if not self._free:
            rows = self.array.shape[0]
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        end = start + len(blocks)
        if end > self.array.shape[1]:
            width = self.array.shape[1]
            while width < end:
                width *= 2
            grown = np.zeros((self.array.shape[0], width), dtype=np.int32)
            grown[:, :self.array.shape[1]] = self.array
            self.array = grown
        self.array[row, start:end] = blocks

    def clear(self, row: int, n: int) -> None:
        self.array[row, :n] = 0

    def free(self, row: int, n: int) -> None:
        self.clear(row, n)
        self._free.append(row)

    def gather(self, rows: list[int], width: int) -> np.ndarray:
        """[len(rows), width]: those rows' first `width` entries (a row may repeat: a verification's rows). Read it
        before the tables change: consecutive rows (a batch admitted together, in order) come as a view."""
        first = rows[0]
        if rows[-1] - first == len(rows) - 1 and rows == list(range(first, first + len(rows))):
            return self.array[first:first + len(rows), :width]
        return self.array[rows, :width]


class RequestStates:
    """Per-request state and seeded generators, kept in step with the scheduler's outputs."""

    def __init__(self, device: str = "cpu"):
        self.device = device  # where seeded generators live: the logits' device
        self.states: dict[str, RequestState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.tables = BlockTables()

    def __getitem__(self, request_id: str) -> RequestState:
        return self.states[request_id]

    def __len__(self) -> int:
        return len(self.states)

    def apply(self, sched: SchedulerOutput) -> None:
        """Bring the states up to date with this step's decisions (before the model runs)."""
        self.release(sched.finished_ids)
        self.forget_blocks(sched.preempted_ids)
        for seq in sched.seqs:
            if seq.new_request is not None:
                self._install(seq.new_request)
            else:
                st = self.states[seq.request_id]
                if seq.new_block_ids:
                    self.tables.write(st.table_row, len(st.block_ids), seq.new_block_ids)
                    st.block_ids.extend(seq.new_block_ids)
                if seq.new_output_token_ids:  # idempotent on the stage that sampled them
                    st.output_token_ids[seq.output_start:] = seq.new_output_token_ids

    def _install(self, new: NewRequestData) -> None:
        # the lists are the scheduler's copies, made for this message: the state takes them over
        old = self.states.get(new.request_id)  # resumed after a preemption: it keeps its row
        row = self.tables.new_row() if old is None else old.table_row
        if old is not None:
            self.tables.clear(row, len(old.block_ids))
        self.tables.write(row, 0, new.block_ids)
        self.states[new.request_id] = RequestState(new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                                                   new.block_ids, new.mm_items, table_row=row)

    def forget_blocks(self, request_ids) -> None:
        """Preempted: their block tables are gone (tokens and the seeded generator stay)."""
        for rid in request_ids:
            st = self.states.get(rid)
            if st is not None:
                self.tables.clear(st.table_row, len(st.block_ids))
                st.block_ids = []

    def release(self, request_ids) -> None:
        """Drop finished requests' state and generators."""
        for rid in request_ids:
            st = self.states.pop(rid, None)
            if st is not None:
                self.tables.free(st.table_row, len(st.block_ids))
            self.generators.pop(rid, None)

    def generator(self, request_id: str) -> torch.Generator | None:
        seed = self.states[request_id].sampling_params.seed
        if seed is None:
            return None
        g = self.generators.get(request_id)
        if g is None:
            # any 64-bit seed (n > 1 children use seed + i) maps onto the generator's unsigned range
            g = self.generators[request_id] = torch.Generator(device=self.device).manual_seed(seed % 2**64)
        return g
