"""Plain data for one image (or one video frame) of a prompt, as it crosses from the input side (API
process) to the engine core and the worker.

A prompt's placeholders are expanded before the core sees it: every image owns `length` consecutive
placeholder tokens starting at `offset`, and the encoder's output rows replace their embeddings.

    prompt ids:  [bos  USER  :  <img> <img> <img> <img>  what  colour  ?  ...]
                               ^offset=3, length=4
    item:        MultiModalItem(modality="image", hash=..., offset=3, length=4, pixels, shape=(3, H, W))

`hash` is a content hash of the preprocessed pixels (and their shape): equal images share one encoder
run (the encoder cache) and the KV blocks that hold them (prefix caching keys blocks by it).
"""
from __future__ import annotations

import hashlib

import msgspec
import numpy as np


class MultiModalItem(msgspec.Struct, array_like=True, frozen=True):
    modality: str  # "image", or "video" for a frame of a video (encoded like an image)
    hash: str  # hex blake2b of the preprocessed pixels and their shape
    offset: int  # index in the prompt of its first placeholder token
    length: int  # placeholder tokens (= encoder output rows)
    pixels: bytes  # preprocessed float32 pixel values, C order
    shape: tuple[int, ...]  # (3, H, W)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def pixel_array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape)

    @classmethod
    def from_pixels(cls, modality: str, pixels: np.ndarray, offset: int, length: int) -> "MultiModalItem":
        arr = np.ascontiguousarray(pixels, dtype=np.float32)
        return cls(modality, pixel_hash(arr), offset, length, arr.tobytes(), tuple(arr.shape))


def pixel_hash(pixels: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr(tuple(pixels.shape)).encode())
    h.update(np.ascontiguousarray(pixels, dtype=np.float32).tobytes())
    return h.hexdigest()
