"""Block pool and KV manager: allocation, ref counts, prefix hits, LRU eviction, bounded waste."""
import pytest

from tokenmill import SamplingParams
from tokenmill.engine.request import Request
from tokenmill.kv.hashing import hash_block
from tokenmill.kv.manager import KVCacheManager


def _req(rid, tokens, **kw):
    return Request(rid, list(tokens), SamplingParams(**kw))


def test_chained_hash_depends_on_prefix_and_extra_key():
    a = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt",)) != a


def test_allocate_and_free_return_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = _req("a", range(10))
    assert kv.allocate_slots(r, 10)
    assert len(kv.req_blocks["a"]) == 3 and kv.num_free_blocks == 7  # waste: one partial block
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # still fits the third block
    assert len(kv.req_blocks["a"]) == 3
    kv.free(r)
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_allocation_fails_cleanly_when_out_of_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots(_req("a", range(8)), 8)
    assert not kv.allocate_slots(_req("b", range(100, 109)), 9)
    assert kv.num_free_blocks == 1 and "b" not in kv.req_blocks
    kv.check_invariants()


def test_prefix_hit_shares_blocks_and_counts_refs():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(10))
    kv.allocate_slots(a, 10)
    b = _req("b", list(range(8)) + [99, 98, 97])
    hit = kv.find_cached_prefix(b)
    assert [x.block_id for x in hit] == kv.block_ids("a")[:2]
    b.num_computed_tokens = 8
    assert kv.allocate_slots(b, 3, hit)
    kv.count_prefix_lookup(b, hit)
    assert all(x.ref_cnt == 2 for x in hit)
    kv.check_invariants()
    kv.free(a)
    assert all(x.ref_cnt == 1 for x in hit)
    kv.free(b)
    kv.check_invariants()
    assert kv.stats.hits == 8 and kv.stats.queries == 11


def test_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)
    assert len(kv.find_cached_prefix(_req("b", range(8)))) == 1  # 8 tokens cached, only 4 reusable


def test_freed_cached_blocks_are_evicted_lru_tail_first():
    pool_blocks = 4
    kv = KVCacheManager(num_blocks=pool_blocks, block_size=2)
    a = _req("a", range(8))
    kv.allocate_slots(a, 8)
    kv.free(a)  # 4 cached free blocks; freed tail first, so the tail is evicted first
    assert kv.num_free_blocks == 4
    b = _req("b", range(100, 102))
    kv.allocate_slots(b, 2)  # evicts one cached block: a's last
    c = _req("c", list(range(8)))
    hit = kv.find_cached_prefix(c)
    assert len(hit) == 3  # a's first three blocks survive
    kv.free(b)
    kv.check_invariants()


def test_salted_requests_do_not_share():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    a = _req("a", range(9))
    kv.allocate_slots(a, 9)
    b = _req("b", range(9))
    b.cache_salt = "tenant-2"
    assert kv.find_cached_prefix(b) == []


@pytest.mark.parametrize("enable", [True, False])
def test_prefix_caching_switch(enable):
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=enable)
    a = _req("a", range(9))
    kv.allocate_slots(a, 9)
    assert len(kv.find_cached_prefix(_req("b", range(9)))) == (2 if enable else 0)


def test_a_failed_step_keeps_the_prefix_hits_earlier_steps_computed():
    """A step that fails takes back out of the prefix cache only the blocks it registered itself: a request
    that hit a prefix computed in an earlier step registered nothing, and the prefix (a shared system prompt)
    stays cached for everyone; before, it was dropped and its holders rolled back to recompute it."""
    from tokenmill.sched.scheduler import Scheduler

    kv = KVCacheManager(16, 4, True)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    system = list(range(100, 116))  # four full blocks

    def ok(out):
        sched.update(out, {s.request_id: [7] for s in out.seqs if s.num_sampled_positions})

    sched.add_request(_req("a", system + [1, 2], max_tokens=50, temperature=0))
    ok(sched.schedule())
    cached = len(kv.pool._cached)
    sched.add_request(_req("b", system + [3, 4], max_tokens=5, temperature=0))
    out = sched.schedule()
    assert {(s.request_id, s.start_pos) for s in out.seqs} == {("a", 18), ("b", 16)}  # b hit a's four blocks
    sched.step_failed(out)
    assert len(kv.pool._cached) == cached == 4 and sched.requests["a"].num_computed_tokens == 18
    out = sched.schedule()  # b is admitted again with the same hit
    assert ("b", 16) in {(s.request_id, s.start_pos) for s in out.seqs}
    kv.check_invariants()


def _sched(num_blocks, **kw):
    from tokenmill.sched.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, 4, enable_caching=False)
    return kv, Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, **kw)


def _run_step(sched):
    out = sched.schedule()
    sched.update(out, {s.request_id: [7] for s in out.seqs if s.num_sampled_positions})
    return out


def test_a_prompt_waiting_for_room_is_not_starved_by_shorter_ones_behind_it():
    """Shorter prompts may pass a prompt that waits for KV room for PASS_STEPS steps, then only with room beyond
    what it needs: a steady stream of them kept the free blocks below its need for as long as they came (1,000
    steps and more)."""
    from tokenmill.sched.scheduler import PASS_STEPS

    kv, sched = _sched(16)
    n = 0

    def short():
        nonlocal n
        n += 1
        sched.add_request(_req(f"s{n}", [5, 6, 7, 10 + n % 50], max_tokens=12, temperature=0, ignore_eos=True))
    short(), short()
    for step in range(1000):
        if step == 10:
            sched.add_request(_req("L", range(10, 58), max_tokens=4, temperature=0, ignore_eos=True))
        if step % 4 == 0:
            short()  # one short request every four steps, for the whole run
        _run_step(sched)
        if step > 10 and "L" not in sched.requests:
            break
    assert "L" not in sched.requests, f"L still waits after {step} steps: {sched.requests['L'].status}"
    assert step < 10 + PASS_STEPS + 60, step  # the window, then the running shorts drain
    kv.check_invariants()


def test_a_preempted_requests_recompute_is_capped_like_a_prefill():
    """long_prefill_token_threshold and max_long_partial_prefills hold for the recompute of a preempted
    request's prompt and output, not its prompt only: the rest of it ran in one uncapped chunk, beside another
    long prompt that max_long_partial_prefills=1 should have held back."""
    kv, sched = _sched(20, long_prefill_token_threshold=8, max_long_partial_prefills=1)
    sched.add_request(_req("B", [5, 6, 7, 8], max_tokens=40, temperature=0, ignore_eos=True))
    sched.add_request(_req("A", [9, 10, 11, 12], max_tokens=50, temperature=0, ignore_eos=True))
    preempted = added = False
    for _ in range(200):
        out = _run_step(sched)
        preempted |= bool(out.preempted_ids)
        chunks = [(s.request_id, s.num_new_tokens) for s in out.seqs if s.num_new_tokens > 1]
        assert all(k <= 8 for _, k in chunks), chunks
        assert sum(k == 8 for _, k in chunks) <= 1, chunks  # one long (capped) prefill at a time
        if preempted and not added:
            sched.add_request(_req("C", range(20, 40), max_tokens=4, temperature=0, ignore_eos=True))
            added = True
        if not sched.requests:
            break
    assert preempted and not sched.requests
    kv.check_invariants()
