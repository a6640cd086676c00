"""What the scheduler decides about images each step: which to encode now (within the encoder budget),
which to encode in the background, and where a step must stop short of an image it cannot have yet.

A step running tokens [start, start + n) of a request needs the encoder rows of every image whose
placeholders overlap that range. For each such image, in prompt order:

    cached on the worker                 -> use it (a hit across requests: the same pixels encode once)
    room in the budget and the cache     -> encode it in this step, before the forward (`encoder_inputs`)
    otherwise (or being encoded aside)   -> the step stops before the image's first placeholder

With overlap on, a request about to join a step that has other requests in it does not encode inline;
its images go to the worker's encoder thread (`encoder_prefetch`) and it joins once they are cached, so
the running requests' decode steps never wait for a vision encoder. Waiting requests' images are
prefetched the same way while they queue.
"""
from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.multimodal.encoder_cache import EncoderCacheManager
from tokenmill.multimodal.inputs import MultiModalItem


class EncoderScheduler:
    def __init__(self, cache: EncoderCacheManager, budget: int, overlap: bool):
        self.cache, self.budget, self.overlap = cache, budget, overlap
        self._left = budget  # encoder rows still free in the step being scheduled
        self._step_hashes: set[str] = set()  # images encoded inline in this step
        self._prefetch: list[MultiModalItem] = []

    def begin_step(self) -> None:
        self._left = self.budget
        self._step_hashes = set()

    def plan(self, req: Request, n: int) -> tuple[int, list[int]]:
        """How many of the step's `n` tokens (from req.num_computed_tokens) can run, and the indices of
        the request's images to encode inline for them."""
        start, todo, need, planned = req.num_computed_tokens, [], 0, set()
        for i, item in enumerate(req.mm_items):
            if item.offset >= start + n:
                break
            h = item.hash
            if item.end <= start or self.cache.cached(h) or h in self._step_hashes or h in planned:
                continue  # (the same image twice in one prompt is encoded once)
            if item.hash not in self.cache.pending and need + item.length <= self._left \
                    and self.cache.room_for(need + item.length):
                todo.append(i)
                planned.add(h)
                need += item.length
                continue
            return item.offset - start, todo
        return n, todo

    def commit(self, req: Request, todo: list[int], n: int) -> None:
        """The request runs tokens [start, start + n) this step, encoding `todo` first."""
        start = req.num_computed_tokens
        for i in todo:
            item = req.mm_items[i]
            self.cache.add(item.hash, item.length, req.request_id)
            self._step_hashes.add(item.hash)
            self._left -= item.length
            self.cache.misses += 1
        for item in req.mm_items:
            if item.offset < start + n and item.end > start and item.hash not in self._step_hashes:
                self.cache.ref(item.hash, req.request_id)
                self.cache.hits += 1

    def encode_aside(self, req: Request, others_running: bool) -> bool:
        """Whether an admitted request's inline encodes should go to the encoder thread instead (overlap:
        other requests would wait for them). Its images are then prefetched and it waits."""
        if not (self.overlap and others_running):
            return False
        self.prefetch(req)
        return any(m.hash in self.cache.pending for m in req.mm_items)  # no room aside: encode inline

    def prefetch(self, req: Request) -> None:
        """Queue the request's images for the encoder thread. Each reservation leaves a step's budget of
        room free, so inline encodes of running requests always fit beside what waiting requests hold."""
        for item in req.mm_items:
            if item.end <= req.num_computed_tokens:
                continue
            if item.hash in self.cache.entries:
                self.cache.ref(item.hash, req.request_id)
                continue
            if not self.cache.room_for(item.length + self.budget):
                return
            self.cache.add(item.hash, item.length, req.request_id, pending=True)
            self._prefetch.append(item)

    def take_prefetch(self) -> list[MultiModalItem]:
        items, self._prefetch = self._prefetch, []
        return items

    def advance(self, req: Request) -> None:
        """After the step: images whose placeholders are all computed no longer need their rows."""
        self.cache.release(req.request_id, [m.hash for m in req.mm_items if m.end <= req.num_computed_tokens])

    def release(self, req: Request) -> None:
        """Finished or preempted: drop its claims (the rows stay cached for whoever comes next)."""
        self.cache.release(req.request_id, [m.hash for m in req.mm_items])
