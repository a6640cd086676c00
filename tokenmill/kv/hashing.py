"""Chained block hashes for prefix caching.

A block's key covers its own tokens *and* everything before it, so equal keys mean equal prefixes:

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes:   h0=H(root, t0..15, extra_keys)
              h1=H(h0,   t16..31, extra_keys)
              (partial block: never hashed, never shared)

`extra_keys` is a tuple of whatever else must match for two blocks to be interchangeable: a cache salt
and the hashes of the images whose placeholders the block holds; LoRA ids
and the like as they land. Its items are str, bytes or int.
"""
from __future__ import annotations

import hashlib
from array import array

import msgspec

_ROOT = b"tokenmill-root"
_encode = msgspec.msgpack.Encoder().encode  # typed and length-prefixed: ("a", "b") never equals ("ab",)


def hash_block(parent: bytes | None, token_ids: list[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(_encode(extra_keys))
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids_of, num_tokens: int, block_size: int,
                        extra_keys_of=None) -> None:
    """Append hashes for every full block among the first `num_tokens` tokens not hashed yet.
    `token_ids_of(start, end)` returns that token range; `extra_keys_of(start, end)` its extra keys
    (a block holding image placeholders is keyed by those images' hashes)."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        start, end = i * block_size, (i + 1) * block_size
        extra = extra_keys_of(start, end) if extra_keys_of is not None else ()
        hashes.append(hash_block(parent, token_ids_of(start, end), extra))
