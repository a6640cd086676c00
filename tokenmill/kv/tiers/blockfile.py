"""The byte format of one stored block, shared by the disk and Redis tiers. The header names the model
(fingerprint) and the block (key), so a file can only ever be read back as the block it was written for;
a CRC-32 over the payload catches corruption and truncation.

    offset  size  field
    0       8     magic  b"TMKVBLK1"
    8       16    model fingerprint (kv/tiers/fingerprint.py)
    24      16    block key (the chained block hash)
    40      1     dtype code
    41      20    shape, 5 x uint32: [layers, 2, block_size, kv_heads, head_dim]
    61      8     payload length in bytes
    69      4     CRC-32 of the payload
    73      ...   payload: the block tensor's raw bytes, C order
"""
from __future__ import annotations

import math
import struct
import zlib

import torch

MAGIC = b"TMKVBLK1"
_HEADER = struct.Struct("<8s16s16sB5IQI")
HEADER_SIZE = _HEADER.size
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}


class CorruptBlock(ValueError):
    """The bytes are not the block they should be: wrong magic, model, key, shape, length or checksum."""


def payload_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def encode_block(fingerprint: bytes, key: bytes, block: torch.Tensor) -> bytes:
    block = block.contiguous()
    payload = block.view(torch.uint8).reshape(-1).numpy()
    header = _HEADER.pack(MAGIC, fingerprint, key, _CODES[block.dtype], *block.shape, payload.nbytes,
                          zlib.crc32(payload))
    return header + payload.tobytes()


def decode_block(data: bytes | bytearray | memoryview, fingerprint: bytes, key: bytes,
                 shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if len(data) < HEADER_SIZE:
        raise CorruptBlock(f"truncated header ({len(data)} bytes)")
    magic, fp, k, code, *rest = _HEADER.unpack_from(data)
    dims, length, crc = tuple(rest[:5]), rest[5], rest[6]
    if magic != MAGIC:
        raise CorruptBlock("not a tokenmill KV block")
    if fp != fingerprint:
        raise CorruptBlock("written by another model or KV layout")
    if k != key:
        raise CorruptBlock("holds another block")
    if code >= len(_DTYPES) or _DTYPES[code] != dtype or dims != tuple(shape):
        raise CorruptBlock(f"shape/dtype {dims}/{code} does not match {tuple(shape)}/{dtype}")
    if length != payload_bytes(shape, dtype):  # a header that agrees with itself but not with its shape
        raise CorruptBlock(f"header says {length} payload bytes, the shape holds {payload_bytes(shape, dtype)}")
    payload = memoryview(data)[HEADER_SIZE:]
    if len(payload) != length:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)
