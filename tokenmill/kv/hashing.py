"""Chained block hashes for prefix caching.

A block's key covers its own tokens *and* everything before it, so equal keys mean equal prefixes:

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes:   h0=H(seed, t0..15, extra)
              h1=H(h0,   t16..31, extra)
              (partial block: never hashed, never shared)
"""
from __future__ import annotations

import hashlib
from array import array

_ROOT = b"tokenmill-root"


def hash_block(parent: bytes | None, token_ids: list[int], extra_key: str | None = None) -> bytes:
    h = hashlib.blake2b(parent or _ROOT, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_key:
        h.update(extra_key.encode())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids_of, num_tokens: int, block_size: int,
                        extra_key: str | None = None) -> None:
    """Append hashes for every full block among the first `num_tokens` tokens not hashed yet.
    `token_ids_of(start, end)` returns that token range."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids_of(i * block_size, (i + 1) * block_size), extra_key))
