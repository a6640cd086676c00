"""Encoder outputs on the worker: the rows that replace image placeholders in the language model's input.

    scheduler says                      here
    encoder_frees: [hash]            -> drop those rows
    encoder_prefetch: [item]         -> encode in the encoder thread (overlaps the decode steps that run
                                        meanwhile); poll() hands finished (and failed) hashes back to the
                                        scheduler
    encoder_inputs: [item]           -> encode before this step's forward, images batched by shape
    then                             -> inputs_embeds: token embeddings with each image's rows spliced in

    step rows:   [ seq A (decode) | seq B tokens 10..29                          ]
    seq B:                          10 .. 13 text | 14 .. 29 = image rows 4 .. 19
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from tokenmill.device_copy import to_device
from tokenmill.multimodal.inputs import MultiModalItem

logger = logging.getLogger("tokenmill")


class EncoderRunner:
    def __init__(self, model, device: str, dtype: torch.dtype, overlap: bool):
        self.model, self.device, self.dtype = model, device, dtype
        self.cache: dict[str, torch.Tensor] = {}  # image hash -> [tokens, hidden]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-encoder") if overlap else None
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.encode_seconds = 0.0
        self.images_encoded = 0  # inline and in the thread
        self.images_prefetched = 0  # of those, in the thread

    # -- what the scheduler sends --------------------------------------------------------------------
    def apply(self, sched) -> None:
        """A step's orders, in this order: evicted rows go first (an image evicted and encoded again in the
        same step keeps its new rows), then this step's encodes, then the background ones."""
        self.free(sched.encoder_frees)
        self.encode(sched.encoder_inputs)
        if sched.encoder_prefetch:
            self.prefetch(sched.encoder_prefetch)

    def free(self, hashes: list[str]) -> None:
        for h in hashes:
            self.cache.pop(h, None)
            self._futures.pop(h, None)  # (a prefetch the scheduler gave up on: its rows are never wanted)

    def prefetch(self, items: list[MultiModalItem]) -> None:
        for item in items:
            self._futures[item.hash] = self._pool.submit(self._encode_aside, [item])
        self.images_prefetched += len(items)

    def poll(self, wait_s: float = 0.0) -> tuple[list[str], list[str]]:
        """Hashes the encoder thread finished since the last poll (their rows are in the cache now), and
        those it raised on (logged here; the scheduler has them encoded in a step instead)."""
        if not self._futures:
            return [], []
        if wait_s:
            wait(list(self._futures.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        done, failed = [], []
        for h in [h for h, f in self._futures.items() if f.done()]:
            try:
                self.cache.update(self._futures.pop(h).result())
                done.append(h)
            except Exception as e:
                logger.warning("the encoder thread failed on image %s (%s: %s); it is encoded in a step instead",
                               h[:12], type(e).__name__, e)
                failed.append(h)
        return done, failed

    @property
    def num_in_flight(self) -> int:
        return len(self._futures)

    def encode(self, items: list[MultiModalItem]) -> None:
        if items:
            self.cache.update(self._encode(items))

    def _encode_aside(self, items: list[MultiModalItem]) -> dict[str, torch.Tensor]:
        """_encode in the encoder thread. On a GPU it runs on a side stream, so its kernels overlap the decode
        steps' on the main stream; the future completes only once its rows are computed, and the rows are
        marked as used by the main stream, so that the allocator does not hand their memory out again while
        steps that splice them in are still queued there."""
        if not str(self.device).startswith("cuda"):
            return self._encode(items)
        main = torch.cuda.current_stream(self.device)  # this thread's current stream: the default one
        side = self._side_stream = getattr(self, "_side_stream", None) or torch.cuda.Stream(self.device)
        with torch.cuda.stream(side):
            out = self._encode(items)
        side.synchronize()
        for rows in out.values():
            rows.record_stream(main)
        return out

    @torch.inference_mode()
    def _encode(self, items: list[MultiModalItem]) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        out = {}
        by_shape: dict[tuple, list[MultiModalItem]] = {}
        for item in items:
            by_shape.setdefault(item.shape, []).append(item)
        for group in by_shape.values():
            # through pinned memory: an inline encode does not wait for the decode step in flight
            pixels = to_device(torch.from_numpy(np.stack([it.pixel_array() for it in group])), self.device)
            pixels = pixels.to(self.dtype)
            rows = self.model.encode_images(pixels)
            for it, r in zip(group, rows):
                if r.shape[0] != it.length:
                    raise ValueError(f"an image gives {r.shape[0]} encoder rows but has {it.length} placeholders")
                out[it.hash] = r
        with self._lock:
            self.encode_seconds += time.perf_counter() - t0
            self.images_encoded += len(items)
        return out

    # -- the step's input ------------------------------------------------------------------------------
    def inputs_embeds(self, input_ids: torch.Tensor, spans: list[tuple[int, int, int, list[MultiModalItem]]]):
        """Token embeddings with image rows spliced in. `spans` holds, per sequence that has images,
        (first row in the step, first token position, token count, its images)."""
        embeds = self.model.embed_input_ids(input_ids)
        for row0, start, n, items in spans:
            for item in items:
                lo, hi = max(start, item.offset), min(start + n, item.end)
                if lo < hi:
                    embeds[row0 + lo - start: row0 + hi - start] = self.cache[item.hash][lo - item.offset: hi - item.offset]
        return embeds

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
