"""What the block pool reports about cached prefixes (vLLM's KV events), instead of changing them
silently. Listeners run synchronously inside scheduling, before the step that reuses an evicted block
runs, so the evicted block's KV data is still intact when `BlockRemoved` arrives: the tiered cache can
spill it from there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union


@dataclass(frozen=True)
class BlockStored:
    """A full block's KV is (or will be, once this step runs) in `block_id`, findable by `block_hash`."""
    block_id: int
    block_hash: bytes
    parent_hash: bytes | None  # the previous block's hash in its sequence; None for a first block


@dataclass(frozen=True)
class BlockRemoved:
    """`block_hash` no longer maps to `block_id`: the block was evicted to hold new tokens, or (kv_valid
    False) its request was preempted before the step that would have computed it ran."""
    block_id: int
    block_hash: bytes
    kv_valid: bool = True


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash maps to any block any more."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
KVEventListener = Callable[[KVEvent], None]
