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
        self._step_items: list[MultiModalItem] = []
        self._prefetch: list[MultiModalItem] = []
        self._inline_only: set[str] = set()  # images the encoder thread failed on: encoded in a step instead

    def begin_step(self) -> None:
        self._left = self.budget
        self._step_hashes, self._step_items = set(), []

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

    def commit(self, req: Request, n: int) -> None:
        """The request runs tokens [start, start + n) this step: it holds every image those tokens overlap,
        and the ones not cached are encoded before the step's forward. The encodes belong to the step, not
        to the request: if it is preempted later in this schedule, a request that counted on the same image
        still finds it encoded. (An image the plan found cached but a preemption's release evicted since is
        encoded here too.)"""
        start = req.num_computed_tokens
        for item in req.mm_items:
            if item.offset >= start + n or item.end <= start:
                continue
            h = item.hash
            if h in self._step_hashes or self.cache.cached(h):
                if h not in self._step_hashes:
                    self.cache.hits += 1
                self.cache.ref(h, req.request_id)
                continue
            self.cache.add(h, item.length, req.request_id)
            self._inline_only.discard(h)
            self._step_hashes.add(h)
            self._step_items.append(item)
            self._left -= item.length
            self.cache.misses += 1

    def take_step_encodes(self) -> list[MultiModalItem]:
        items, self._step_items = self._step_items, []
        return items

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
            if item.hash in self._inline_only:
                continue
            if not self.cache.room_for(item.length + self.budget):
                return
            self.cache.add(item.hash, item.length, req.request_id, pending=True)
            self._prefetch.append(item)

    def take_prefetch(self) -> list[MultiModalItem]:
        items, self._prefetch = self._prefetch, []
        return items

    def abandon(self, encodes: list[MultiModalItem], prefetches: list[MultiModalItem], frees: list[str]) -> None:
        """A step that failed (or a schedule that raised) may never have reached the worker's encoder: the
        images it ordered leave the ledger, to be encoded again when needed (rows the worker did make are
        freed at the next step), and the rows it was to free are freed at the next step."""
        self.cache.free_again(frees)
        for item in encodes + prefetches:
            self.cache.drop(item.hash)

    def abandon_schedule(self) -> None:
        """schedule() raised: nothing it planned reaches the worker (its evictions still do)."""
        self.abandon(self.take_step_encodes(), self.take_prefetch(), [])

    def prefetch_failed(self, hashes: list[str]) -> None:
        """The encoder thread raised on these images: they are encoded in a step instead, where an error
        fails that step and reaches its requests (a retry in the thread could fail unseen for ever)."""
        for h in hashes:
            self.cache.drop(h)
        self._inline_only.update(hashes)

    def advance(self, req: Request) -> None:
        """Images whose placeholders were all computed by earlier steps no longer need their rows (the ones
        this step finishes are released at the next: the worker frees evicted rows before its forward)."""
        self.cache.release(req.request_id, [m.hash for m in req.mm_items if m.end <= req.num_computed_tokens])

    def release(self, req: Request) -> None:
        """Finished or preempted: drop its claims (the rows stay cached for whoever comes next)."""
        self.cache.release(req.request_id, [m.hash for m in req.mm_items])
