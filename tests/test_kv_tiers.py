"""KV tiers below the pool (host RAM, disk, Redis): byte format, LRU bounds, prefix lookups across tiers,
greedy identity with hits from each tier, restarts, and faults that must degrade to recompute."""
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import make_llm, random_prompts
from tokenmill import SamplingParams
from tokenmill.engine.request import Request
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.tiers import disk as disk_mod
from tokenmill.kv.tiers.blockfile import HEADER_SIZE, CorruptBlock, decode_block, encode_block
from tokenmill.kv.tiers.chain import TierChain
from tokenmill.kv.tiers.disk import DiskTier
from tokenmill.kv.tiers.host import HostTier

FP, SHAPE, DT = b"f" * 16, (2, 2, 4, 2, 8), torch.bfloat16
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _block(seed):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(DT)


def _key(i):
    return i.to_bytes(16, "little")


# -- the byte format and the tiers on their own ------------------------------------------------------------
def test_block_format_round_trips_and_rejects_every_kind_of_damage():
    b = _block(0)
    data = encode_block(FP, _key(1), b)
    assert torch.equal(decode_block(data, FP, _key(1), SHAPE, DT), b)
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 5] ^= 0xFF
    damaged = {"truncated": data[:-3], "header only": data[:HEADER_SIZE - 1], "flipped byte": bytes(flipped)}
    for why, bad in damaged.items():
        with pytest.raises(CorruptBlock):
            decode_block(bad, FP, _key(1), SHAPE, DT)
    with pytest.raises(CorruptBlock, match="another model"):
        decode_block(data, b"g" * 16, _key(1), SHAPE, DT)
    with pytest.raises(CorruptBlock, match="another block"):
        decode_block(data, FP, _key(2), SHAPE, DT)
    with pytest.raises(CorruptBlock, match="shape"):
        decode_block(data, FP, _key(1), SHAPE, torch.float32)


def test_host_tier_is_a_byte_bounded_lru():
    per = _block(0).nbytes
    host = HostTier(capacity_bytes=3 * per)
    for i in range(3):
        host.put(_key(i), _block(i))
    assert host.get(_key(0)) is not None  # 0 is now the most recent
    host.put(_key(3), _block(3))  # evicts 1, the least recently used
    assert [host.exists(_key(i)) for i in range(4)] == [True, False, True, True]
    assert host.occupancy() == (3, 3 * per)
    host.check_invariants()


def test_disk_tier_survives_a_restart_and_trims_to_its_cap(tmp_path):
    per = len(encode_block(FP, _key(0), _block(0)))
    d = DiskTier(str(tmp_path), 4 * per, FP, SHAPE, DT)
    for i in range(3):
        d.put(_key(i), _block(i))
    assert not any(n.endswith(".tmp") for _, _, files in os.walk(tmp_path) for n in files)  # atomic writes
    again = DiskTier(str(tmp_path), 2 * per, FP, SHAPE, DT)  # a new engine with a smaller cap: oldest goes
    assert [again.exists(_key(i)) for i in range(3)] == [False, True, True]
    assert torch.equal(again.get(_key(2)), _block(2))
    again.check_invariants()
    other = DiskTier(str(tmp_path), 4 * per, b"g" * 16, SHAPE, DT)  # another model: its own directory
    assert not other.exists(_key(2))


def test_disk_tier_sees_blocks_another_engine_wrote(tmp_path):
    a = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    b = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    a.put(_key(7), _block(7))
    assert b.exists(_key(7)) and torch.equal(b.get(_key(7)), _block(7))


def test_corrupt_or_truncated_disk_block_is_a_miss_and_is_deleted(tmp_path, caplog):
    d = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    d.put(_key(1), _block(1))
    d.put(_key(2), _block(2))
    with open(d._path(_key(1)), "r+b") as f:
        f.seek(HEADER_SIZE + 10)
        f.write(b"\x00\xff\x00")
    with open(d._path(_key(2)), "r+b") as f:
        f.truncate(HEADER_SIZE + 7)
    assert d.get(_key(1)) is None and d.get(_key(2)) is None
    assert not os.path.exists(d._path(_key(1))) and not d.exists(_key(2))
    assert d.stats.errors == 2 and "checksum" in caplog.text
    d.check_invariants()


def test_the_fingerprint_covers_what_changes_the_kv(tmp_path):
    """Blocks are shared only between engines whose KV would be bit-identical: dummy weights drawn for two
    configs (rope, norms) differ, as do an int8 and a float vision encoder (image tokens' embeddings)."""
    from tokenmill.kv.tiers.fingerprint import model_fingerprint, weights_identity
    dirs = []
    for i, theta in enumerate((10000.0, 500000.0, 10000.0)):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text(f'{{"rope_theta": {theta}}}')
        dirs.append(str(d))
    ids = [weights_identity(d, "dummy", 0) for d in dirs]
    assert ids[0] != ids[1] and ids[0] == ids[2] and ids[0] != weights_identity(dirs[0], "dummy", 1)
    (tmp_path / "m2" / "preprocessor_config.json").write_text('{"image_mean": [0.5, 0.5, 0.5]}')
    assert weights_identity(dirs[2], "dummy", 0) != ids[0]
    kw = dict(architecture="LlavaForConditionalGeneration", weights_id=ids[0], dtype="torch.float32", block_size=16,
              kv_block_shape=(2, 2, 16, 2, 8), kv_layout="nhd", quantization=None)
    assert model_fingerprint(**kw) != model_fingerprint(**kw, mm_encoder_quantization="w8a8")


def test_the_weights_identity_sees_a_change_between_the_files_ends(tmp_path):
    """A fine-tune whose first and last MiB match its base's (a LoRA merged into the middle layers, the
    embeddings and head frozen) had its base's identity: a shared disk or Redis tier would serve it the
    base's KV."""
    from tokenmill.kv.tiers.fingerprint import weights_identity
    base = torch.randn(3 << 20, generator=torch.Generator().manual_seed(0)).numpy().tobytes()  # 12 MiB
    tuned = bytearray(base)
    tuned[6 << 20:(6 << 20) + (1 << 18)] = bytes(1 << 18)  # 256 KiB in the middle
    ids = []
    for name, data in (("base", base), ("tuned", bytes(tuned)), ("again", base)):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(data)
        ids.append(weights_identity(str(d), "safetensors", 0))
    assert ids[0] != ids[1] and ids[0] == ids[2]


def test_a_header_that_agrees_with_itself_but_not_with_its_shape_is_corrupt():
    import struct
    import zlib
    data = encode_block(FP, _key(1), _block(1))
    payload = data[HEADER_SIZE:HEADER_SIZE + 64]  # a shorter payload, its length and CRC written to match
    magic, fp, key, code, *rest = struct.unpack_from("<8s16s16sB5IQI", data)
    header = struct.pack("<8s16s16sB5IQI", magic, fp, key, code, *rest[:5], len(payload), zlib.crc32(payload))
    with pytest.raises(CorruptBlock, match="payload bytes"):
        decode_block(header + payload, FP, _key(1), SHAPE, DT)


def test_a_block_stored_again_while_the_index_is_checked_stays_indexed(tmp_path, monkeypatch):
    """_revalidate stats the index's files off the lock. A block evicted and stored again (another thread)
    after its stat said "gone" must stay indexed: dropping it would leave its new file on disk, outside the
    index and the cap."""
    per = len(encode_block(FP, _key(0), _block(0)))
    d = DiskTier(str(tmp_path), 8 * per, FP, SHAPE, DT)
    for i in range(3):
        d.put(_key(i), _block(i))
    os.unlink(d._path(_key(2)))  # really gone: still dropped
    target = d._path(_key(1))
    real_exists = os.path.exists

    def exists(path):
        if path != target:
            return real_exists(path)
        d._forget(_key(1))  # the store thread: evicted and written again, just after this stat
        os.unlink(target)
        d.put(_key(1), _block(1))
        return False
    monkeypatch.setattr(disk_mod.os.path, "exists", exists)
    d._revalidate()
    monkeypatch.setattr(disk_mod.os.path, "exists", real_exists)
    assert d.occupancy() == (2, 2 * per)  # each file on disk is counted (before any lookup stats it again)
    assert d.exists(_key(1)) and not d.exists(_key(2)) and d.exists(_key(0))
    assert torch.equal(d.get(_key(1)), _block(1))
    d.check_invariants()


def test_disk_faults_a_read_or_a_store_must_not_hang_on_or_keep_repeating(tmp_path, monkeypatch):
    """Anything but a regular file of a block's size is corrupt (a FIFO would block the load thread in
    read()); a deleted directory is noticed for the whole index at the first miss (its blocks are stored again
    at once, not found missing one load at a time); a cap lowered by a full disk is tried again later."""
    per = len(encode_block(FP, _key(0), _block(0)))
    d = DiskTier(str(tmp_path), 8 * per, FP, SHAPE, DT)
    for i in range(4):
        d.put(_key(i), _block(i))
    os.unlink(d._path(_key(0)))
    os.mkfifo(d._path(_key(0)))
    assert d.get(_key(0)) is None and not os.path.exists(d._path(_key(0)))  # at once, and deleted
    assert d.stats.errors == 1
    checks = []
    revalidate = d._revalidate
    d._revalidate = lambda: (checks.append(1), revalidate())
    assert d.get(_key(77)) is None and not checks  # a plain miss (never indexed) checks nothing
    shutil.rmtree(d.dir)
    assert d.get(_key(1)) is None and checks
    assert d.occupancy() == (0, 0) and not any(d.exists(_key(i)) for i in range(4))  # the whole index
    d.put(_key(2), _block(2))  # stored again
    assert torch.equal(d.get(_key(2)), _block(2))
    real_write = DiskTier._write_atomic

    def full(self, path, data):
        raise OSError(28, "No space left on device", path)
    monkeypatch.setattr(DiskTier, "_write_atomic", full)
    d.put(_key(3), _block(3))
    assert d.capacity_bytes == per  # what the disk held
    monkeypatch.setattr(DiskTier, "_write_atomic", real_write)  # space freed
    d.put(_key(4), _block(4))
    assert d.capacity_bytes == per and d.occupancy()[0] == 1  # still the lowered cap, for a while
    d._cap_lowered_at -= disk_mod._CAP_RETRY_S + 1
    for i in (5, 6):
        d.put(_key(i), _block(i))
    assert d.capacity_bytes == 8 * per and d.occupancy()[0] == 3  # back to the configured cap
    d.check_invariants()


def test_a_stat_that_hangs_costs_a_lookup_a_short_wait_not_the_engine(tmp_path, monkeypatch):
    """Lookups run on the scheduler's thread. A block another engine wrote (not in this one's index) is found by
    a stat, which runs on the tier's own thread: one that hangs (a dead network mount) is waited for briefly,
    then lookups of unindexed blocks miss until it returns; indexed blocks are still found."""
    other = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    d = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    other.put(_key(1), _block(1))
    other.put(_key(2), _block(2))
    d.put(_key(3), _block(3))
    assert d.exists(_key(1))  # another engine's block, found by a stat
    gate, real_stat = threading.Event(), os.stat

    def hanging_stat(path, *a, **kw):
        if threading.current_thread().name == "tokenmill-disk-stat":
            gate.wait(30)
        return real_stat(path, *a, **kw)
    monkeypatch.setattr(disk_mod.os, "stat", hanging_stat)
    t0 = time.monotonic()
    assert not d.exists(_key(2))  # a miss after the short wait, not a hang
    assert d.exists(_key(3)) and not d.exists(_key(2))  # indexed blocks still hit; no second stat is started
    assert time.monotonic() - t0 < 5
    d._lookups_off_until = 0.0  # the pause is over, but the hung stat has not returned: still no new one
    assert not d.exists(_key(2))
    gate.set()
    deadline = time.monotonic() + 10
    while not d._stat_running.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not d.exists(_key(2)) and d._lookups_paused()  # it returned, slowly: a slow mount pauses lookups
    d._lookups_off_until = 0.0
    assert d.exists(_key(2))  # the mount is back


def test_a_slow_hand_off_to_the_stat_thread_costs_one_lookup_not_a_pause(tmp_path, monkeypatch):
    """On an overloaded host the stat thread may start a stat late. That lookup misses (the scheduler does not
    wait), but the stat itself was fast: lookups must not pause for _STAT_OFF_S (10 s of misses)."""
    other = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    d = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    other.put(_key(1), _block(1))
    other.put(_key(2), _block(2))
    assert d.exists(_key(1))  # (the thread exists)
    submit = d._stats.submit
    t0 = time.monotonic()
    monkeypatch.setattr(d._stats, "submit", lambda path: _late(submit, path))
    assert not d.exists(_key(2))  # missed: the stat came back after the wait
    assert time.monotonic() - t0 < 1
    deadline = time.monotonic() + 10
    while not d._stat_running.done():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    monkeypatch.setattr(d._stats, "submit", submit)
    assert d.exists(_key(2)) and not d._lookups_paused()


def _late(submit, path):
    """A Future for `submit(path)`, handed to the thread 3x the scheduler's wait from now (not waited for)."""
    from concurrent.futures import Future

    outer: Future = Future()

    def hand_off():
        inner = submit(path)
        inner.add_done_callback(lambda f: (setattr(outer, "took", getattr(f, "took", 0.0)), outer.set_result(f.result())
                                           if f.exception() is None else outer.set_exception(f.exception())))
    threading.Timer(3 * disk_mod._SLOW_STAT_S, hand_off).start()
    return outer


def test_a_dropped_disk_tier_ends_its_stat_thread(tmp_path):
    import gc

    d = DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    assert not d.exists(_key(9))
    thread = d._stats.thread
    assert thread.is_alive()
    del d
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "the stat thread outlived its tier"


def test_a_disk_tier_that_cannot_make_its_directory_starts_empty(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    d = DiskTier(str(tmp_path / "file"), 1 << 20, FP, SHAPE, DT)  # the engine starts; the tier misses
    assert d.stats.errors == 1 and "starts empty" in caplog.text
    d.put(_key(1), _block(1))
    assert d.get(_key(1)) is None and not d.exists(_key(1)) and d.stats.errors >= 2  # dropped, missed
    d.check_invariants()


def test_chain_lookup_walks_tiers_block_by_block(tmp_path):
    host, disk = HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    for i in (1, 2):
        host.put(_key(i), _block(i))
    for i in (0, 1, 3):
        disk.put(_key(i), _block(i))
    chain = TierChain([host, disk])
    assert chain.lookup([_key(i) for i in range(5)]) == [1, 1, 0, 1]  # the docstring's picture


def test_preemption_inside_the_step_unregisters_blocks_it_never_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    r = Request("a", list(range(10)), SamplingParams())
    assert kv.allocate_slots(r, 10)  # registers two full blocks whose KV this step would compute
    kv.free(r, num_valid_tokens=0)  # preempted before the step ran
    assert kv.find_cached_prefix(Request("b", list(range(10)), SamplingParams())) == []
    kv.check_invariants()


def _tiered_scheduler():
    """A scheduler over 8 blocks of 4 tokens with a host tier and its transfer worker, and a step that runs
    the transfers as the engine core does (the model itself is not needed here)."""
    from tokenmill.sched.scheduler import Scheduler
    from tokenmill.worker.kv_transfer import KVTransferWorker

    chain = TierChain([HostTier(1 << 30)])
    kv = KVCacheManager(8, 4, True, chain)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    xfer = KVTransferWorker(torch.zeros(1, 2, 8, 4, 1, 2), chain, 2.0)

    def step(fail_before_loads: bool = False):
        sched.finish_loads(xfer.poll())
        out = sched.schedule()
        xfer.cancel(out.kv_load_cancels)
        xfer.store(out.kv_stores)
        if fail_before_loads:  # the core's failure path when a store raises (a device OOM in the gather)
            sched.loads_not_started(out.kv_loads)
            sched.step_failed(out)
            return out
        xfer.start_loads(out.kv_loads)
        sched.update(out, {q.request_id: [7] for q in out.seqs if q.num_sampled_positions})
        return out
    return kv, sched, xfer, step


def _evict_tail_of(doc, kv, sched, step):
    """`doc` computed, then pushed out by other traffic: its tail blocks go to the host tier, its head stays."""
    sched.add_request(Request("a", doc, SamplingParams(max_tokens=1, temperature=0)))
    step()
    sched.add_request(Request("b", list(range(500, 524)), SamplingParams(max_tokens=1, temperature=0)))
    step()


def test_a_tier_load_after_pool_hits_is_used_not_recomputed():
    """A prompt whose head is still in the pool and whose tail a tier holds (the usual shape: the tail is
    evicted first) runs only what neither holds once its load lands; it was prefilled whole again, the load
    thrown away while the tier counted it as a hit."""
    kv, sched, xfer, step = _tiered_scheduler()
    doc = list(range(100, 120))  # five blocks
    _evict_tail_of(doc, kv, sched, step)
    sched.add_request(Request("c", doc, SamplingParams(max_tokens=1, temperature=0)))
    out = step()
    (load,) = out.kv_loads
    assert load.request_id == "c" and sched.loading["c"].num_computed_tokens > 0  # pool hits, then the load
    for _ in range(250):  # until the load lands and c is admitted
        time.sleep(0.02)
        out = step()
        if out.seqs:
            break
    assert [(q.request_id, q.start_pos) for q in out.seqs] == [("c", 16)]  # the last block's tokens only
    kv.check_invariants()


def test_a_tier_load_leaves_the_blocks_running_prefills_still_need():
    """A tier load takes only blocks that the running chunked prefills do not still need (as admission does):
    it took them all, and the prefill's next chunks then evicted the loaded blocks before their request could
    use them (it recomputed all but one)."""
    kv, sched, xfer, step = _tiered_scheduler()
    doc = list(range(100, 120))
    sched.add_request(Request("a", doc, SamplingParams(max_tokens=1, temperature=0)))
    step()
    sched.add_request(Request("b", list(range(500, 532)), SamplingParams(max_tokens=1, temperature=0)))
    step()  # b's eight blocks push all of a's out to the host tier
    sched.max_num_batched_tokens, sched.prefill_cap = 12, 8  # r's 28 tokens go in chunks of 8
    sched.add_request(Request("r", list(range(700, 728)), SamplingParams(max_tokens=1, temperature=0)))
    step()
    sched.add_request(Request("c", doc, SamplingParams(max_tokens=1, temperature=0)))
    first_c = None
    for _ in range(100):
        out = step()
        assert not (out.kv_loads and "r" in sched.requests), "a load took the blocks r's prefill still needs"
        first_c = next((q.start_pos for q in out.seqs if q.request_id == "c"), None)
        if first_c is not None:
            break
        time.sleep(0.02)
    assert first_c == 16  # its four loaded blocks were there to use
    kv.check_invariants()


def test_a_step_that_fails_before_its_loads_start_frees_them():
    """A step that fails after the scheduler made its tier loads but before the transfer worker got them
    (a store's copy raised): the loads end at once, nothing loaded. Their blocks were held for good, and every
    later request with that prefix waited on a load that would never report."""
    kv, sched, xfer, step = _tiered_scheduler()
    doc = list(range(100, 120))
    _evict_tail_of(doc, kv, sched, step)
    sched.add_request(Request("c", doc, SamplingParams(max_tokens=1, temperature=0)))
    out = step(fail_before_loads=True)
    assert [load.request_id for load in out.kv_loads] == ["c"]
    assert not sched.loading and "c" in sched.requests
    sched.abort(list(sched.requests))  # what the engine core does after a failed step
    assert sched.num_unfinished == 0 and kv.num_free_blocks == 8
    sched.add_request(Request("d", doc, SamplingParams(max_tokens=1, temperature=0)))
    for _ in range(20):  # d is served: by a load of its own, then the pool
        out = step()
        if any(q.request_id == "d" for q in out.seqs):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("a request with the failed load's prefix was never scheduled")
    kv.check_invariants()


# -- the engine with tiers -----------------------------------------------------------------------------------
DOC_LEN, POOL = 150, dict(num_kv_blocks=20, max_model_len=256)


def _workload(seed=0):
    """Rounds of prompts: questions about one shared document, with other traffic in between that evicts
    the document's blocks from the 20-block pool (rounds 0, 3 and 6 ask about the document)."""
    doc, q1, q2, q3, *fill = random_prompts([DOC_LEN, 12, 9, 15, 200, 200, 200, 200], seed=seed)
    p = lambda toks: {"prompt_token_ids": toks}  # noqa: E731
    return [[p(doc + q1)], [p(fill[0])], [p(fill[1])], [p(doc + q2), p(doc + q3)], [p(fill[2])], [p(fill[3])],
            [p(doc + q1)]]


def _run(llm, rounds, sp=GREEDY):
    """Each round's greedy tokens. Between rounds, queued stores are let through to disk and Redis (they
    are asynchronous; on a loaded machine they could otherwise trail the next round and turn its hits
    into correct but untested recomputes)."""
    out = []
    for r in rounds:
        out.append([o.outputs[0].token_ids for o in llm.generate(r, sp, use_tqdm=False)])
        xfer = llm.llm_engine.core.kv_transfer
        if xfer is not None:
            assert xfer.flush(30.0)
    return out


@pytest.fixture(scope="module")
def plain_outputs(llama_dir):
    return _run(make_llm(llama_dir, **POOL), _workload())


def _tier_stats(llm):
    return llm.llm_engine.get_stats().kv_tiers


def _check_idle(llm):
    llm.llm_engine.check_invariants()  # every pool block back, tier byte counts exact
    assert llm.llm_engine.get_stats().num_loading_kv == 0


@pytest.mark.parametrize("tiers", ["host", "disk", "host+disk"])
def test_greedy_identical_with_hits_from_each_tier(llama_dir, tmp_path, plain_outputs, tiers):
    kw = {}
    if "host" in tiers:
        kw["kv_host_cache_gb"] = 0.05
    if "disk" in tiers:
        kw["kv_disk_cache_dir"] = str(tmp_path)
    llm = make_llm(llama_dir, **POOL, **kw)
    assert _run(llm, _workload()) == plain_outputs
    stats = _tier_stats(llm)
    first = tiers.split("+")[0]
    assert stats[first]["hit_tokens"] >= 2 * 144, stats  # rounds 3 and 6 came back from the tier
    assert stats[first]["blocks_loaded"] > 0 and stats[first]["bytes_stored"] > 0
    _check_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_gpu_store_path_gathers_blocks_to_the_host(llama_dir, tmp_path, plain_outputs, async_scheduling):
    """On a GPU stored blocks are gathered together and land in the tiers at a later poll, once their copy to
    the host is done (KVTransferWorker.store / land): that path, forced on a CPU engine, with and without async
    scheduling, gives each block its own contiguous copy, the same tokens and tier hits."""
    llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05, kv_disk_cache_dir=str(tmp_path),
                   async_scheduling=async_scheduling)
    core = llm.llm_engine.core
    xfer = core.kv_transfer
    assert not xfer.gather_to_host  # a CPU cache: the tiers could take views' clones directly
    xfer.gather_to_host = True
    blocks = xfer._host_blocks([3, 1])
    for b, i in zip(blocks, (3, 1)):
        assert b.is_contiguous() and torch.equal(b, xfer.block(i)) and b.untyped_storage().nbytes() == b.nbytes
    landed, land = [], xfer.land

    def spy(wait=False):
        landed.append((len(xfer._landing), wait))
        land(wait)
    xfer.land = spy
    assert _run(llm, _workload()) == plain_outputs
    assert any(n and not wait for n, wait in landed)  # stores waited for a step's poll to land
    # a GPU's last stores whose copy is still running when the engine goes idle: it counts as unfinished and
    # steps once more, waiting for the copy (nothing to overlap), so the blocks reach the tiers and its peers
    from tokenmill.sched.output import BlockStore

    class CopyEvent:  # a torch.cuda.Event whose copy has not finished yet
        def query(self):
            return False

        def synchronize(self):
            self.waited = True
    event = CopyEvent()
    xfer._landing.append(([BlockStore(5, b"last-step-store")], xfer.block(5).unsqueeze(0).clone(), event))
    assert xfer.has_landing and core.has_unfinished()
    llm.llm_engine.step()
    assert event.waited and not xfer.has_landing and not core.has_unfinished()
    assert xfer.chain.host.get(b"last-step-store") is not None
    stats = _tier_stats(llm)
    assert stats["host"]["hit_tokens"] >= 2 * 144 and stats["disk"]["bytes_stored"] > 0, stats
    if async_scheduling:
        assert core.scheduler.num_run_ahead > 0  # the steps overlapped
    _check_idle(llm)


def test_write_through_backs_blocks_up_as_they_fill(llama_dir, tmp_path, plain_outputs):
    llm = make_llm(llama_dir, **POOL, kv_disk_cache_dir=str(tmp_path), kv_cache_store_policy="write_through")
    first = _run(llm, _workload()[:1])
    time.sleep(0.5)  # the store thread writes the files
    stored = _tier_stats(llm)["disk"]["blocks_stored"]
    assert first == plain_outputs[:1] and stored >= DOC_LEN // 16  # stored without any eviction
    assert _run(llm, _workload()[1:]) == plain_outputs[1:]
    _check_idle(llm)


def test_tiers_under_chunked_prefill_and_preemption(llama_dir, tmp_path):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(num_kv_blocks=17, max_model_len=256, max_num_batched_tokens=32)
    r = _workload(seed=3)
    # concurrent fills (2 x 15 blocks > 17: the second waits for room), and three short prompts whose
    # decodes outgrow the pool together (3 x 7 blocks > 17: preemption, then a recompute in chunks)
    growing = [{"prompt_token_ids": t} for t in random_prompts([64, 64, 64], seed=9)]
    rounds = [r[0], r[1] + r[2], growing, r[3], r[4] + r[5] + r[6]]
    plain = _run(make_llm(llama_dir, **kw), rounds, sp)
    llm = make_llm(llama_dir, **kw, kv_host_cache_gb=0.05, kv_disk_cache_dir=str(tmp_path))
    assert _run(llm, rounds, sp) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_tiers["host"]["hit_tokens"] > 0
    _check_idle(llm)


class _SlowTier(HostTier):
    """A host tier whose reads take `delay` seconds per block, and wait for `gate` when one is given: loads
    stay in flight for a while, or until the test lets them finish."""

    def __init__(self, delay, gate: threading.Event | None = None):
        super().__init__(1 << 26)
        self.delay, self.gate = delay, gate

    def get(self, key):
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.delay)
        return super().get(key)


def _with_slow_tier(llm, delay, gate: threading.Event | None = None):
    core = llm.llm_engine.core
    slow = _SlowTier(delay, gate)
    core.kv.tiers.tiers[0] = core.kv.tiers.host = core.kv_transfer.chain.host = slow
    return slow


def _document_in_a_gated_host_tier(llama_dir, plain_outputs):
    """An engine whose host tier holds the workload's document after its first three rounds, and whose reads
    now wait for the returned gate: (llm, gate, the workload's rounds)."""
    llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05)
    gate = threading.Event()
    gate.set()
    _with_slow_tier(llm, 0.0, gate)
    rounds = _workload()
    assert _run(llm, rounds[:3]) == plain_outputs[:3]
    gate.clear()
    return llm, gate, rounds


def test_requests_arriving_while_a_load_is_in_flight(llama_dir, plain_outputs):
    # q2's load waits until "other" has finished, however fast or slow this machine is
    llm, gate, rounds = _document_in_a_gated_host_tier(llama_dir, plain_outputs)
    eng = llm.llm_engine
    queries = eng.get_stats().prefix_cache_queries
    eng.add_request("q2", rounds[3][0], GREEDY)
    eng.step()  # q2's load starts
    assert eng.get_stats().num_loading_kv == 1
    eng.add_request("other", {"prompt_token_ids": random_prompts([30], seed=9)[0]}, GREEDY)
    eng.add_request("q3", rounds[3][1], GREEDY)  # same document: waits for q2's blocks, no second load
    done, ran_during_load = {}, False
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        ran_during_load |= eng.get_stats().num_loading_kv > 0 and "other" in done
        if "other" in done:
            gate.set()
    assert [done["q2"], done["q3"]] == plain_outputs[3]
    assert ran_during_load  # the other request finished while the load was still running
    assert _tier_stats(llm)["host"]["blocks_loaded"] == DOC_LEN // 16  # loaded once, for q2 only
    # each request's prefix lookup counted once (q3 was counted on every step it waited for q2's load)
    lens = [len(rounds[3][0]["prompt_token_ids"]), 30, len(rounds[3][1]["prompt_token_ids"])]
    assert eng.get_stats().prefix_cache_queries - queries == sum(lens)
    _check_idle(llm)


def test_an_id_reused_after_its_load_was_aborted_loads_again(llama_dir, plain_outputs):
    """Abort a request while its tier load is in flight, then add a request under the same id (the offline
    engine lets callers pick ids): the abort's cancel must not reach the new request's load (it was applied
    after the step started that load, which was then cancelled at once, and the prompt recomputed)."""
    llm, gate, rounds = _document_in_a_gated_host_tier(llama_dir, plain_outputs)
    eng = llm.llm_engine
    eng.add_request("q2", rounds[3][0], GREEDY)
    eng.step()  # its load starts, and waits for the gate
    assert eng.get_stats().num_loading_kv == 1
    eng.abort_request(["q2"])
    gate.set()
    eng.add_request("q2", rounds[3][0], GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done["q2"].outputs[0].token_ids == plain_outputs[3][0]
    assert done["q2"].num_cached_tokens >= DOC_LEN // 16 * 16  # the document came from the host tier
    _check_idle(llm)


def test_an_id_whose_aborted_load_has_not_reported_is_still_in_use(llama_dir):
    """The scheduler tracks loads by request id until they report back: a new request under an id whose
    aborted load is still out is refused (it would replace the first load's entry, whose blocks then leak)."""
    from tokenmill.engine.request import Request
    scheduler = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05).llm_engine.core.scheduler
    scheduler.loading["q"] = Request("q", [5, 6, 7], GREEDY)  # as an aborted request whose load is still out
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(Request("q", [5, 6, 7], GREEDY))


def test_late_load_falls_back_to_recompute(llama_dir, plain_outputs, caplog):
    llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05, kv_load_timeout_s=0.1)
    _with_slow_tier(llm, 0.05)  # 9 blocks: ~0.45 s, well past the deadline
    assert _run(llm, _workload()) == plain_outputs
    assert "missed its 0.1 s deadline" in caplog.text
    time.sleep(0.6)  # the abandoned read finishes and must write nothing
    _check_idle(llm)


class _StuckOnce(HostTier):
    """A host tier whose first read never returns (until the test ends): a hung network mount."""

    def __init__(self):
        super().__init__(1 << 26)
        self.release, self.reads = threading.Event(), 0

    def get(self, key):
        self.reads += 1
        if self.reads == 1:
            self.release.wait(60)
        return super().get(key)


def test_a_read_that_never_returns_does_not_hold_up_later_loads(llama_dir, plain_outputs, caplog):
    llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05, kv_load_timeout_s=1.0)
    core = llm.llm_engine.core
    stuck = _StuckOnce()
    core.kv.tiers.tiers[0] = core.kv.tiers.host = core.kv_transfer.chain.host = stuck
    try:
        rounds = _workload()
        assert _run(llm, rounds[:3]) == plain_outputs[:3]
        assert _run(llm, rounds[3:4]) == plain_outputs[3:4]  # its load's thread sticks in the first read
        assert caplog.text.count("missed its 1.0 s deadline") == 1 and "starting another load thread" in caplog.text
        hits = _tier_stats(llm)["host"]["hit_tokens"]
        assert _run(llm, rounds[4:]) == plain_outputs[4:]
        # the document's blocks load on the new thread, in time (they queued behind the stuck read before)
        assert _tier_stats(llm)["host"]["hit_tokens"] >= hits + 144
        assert caplog.text.count("missed its") == 1
        _check_idle(llm)
    finally:
        stuck.release.set()


def test_abort_while_loading_frees_the_blocks(llama_dir):
    llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05)
    _with_slow_tier(llm, 0.05)
    rounds = _workload()
    _run(llm, rounds[:3])
    eng = llm.llm_engine
    eng.add_request("q", rounds[3][0], GREEDY)
    eng.step()
    assert eng.get_stats().num_loading_kv == 1
    eng.abort_request(["q"])
    while eng.has_unfinished_requests():
        eng.step()
    _check_idle(llm)
    assert eng.core.kv.num_free_blocks == POOL["num_kv_blocks"]


# -- restarts and disk faults ------------------------------------------------------------------------------
_RESTART_SCRIPT = """
import json, sys
from tests.conftest import make_llm
from tokenmill import SamplingParams
path, cache, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = make_llm(path, num_kv_blocks=20, max_model_len=256, kv_disk_cache_dir=cache)
out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
print(json.dumps([out[0].outputs[0].token_ids, llm.llm_engine.get_stats().kv_tiers["disk"]["hit_tokens"]]))
"""


def test_a_restarted_engine_gets_disk_hits(llama_dir, tmp_path, plain_outputs):
    import json

    rounds = _workload()
    cache = str(tmp_path / "kv")

    def run(prompt):
        res = subprocess.run([sys.executable, "-c", _RESTART_SCRIPT, llama_dir, cache, json.dumps(prompt)],
                             capture_output=True, text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])

    tokens, hits = run(rounds[0][0]["prompt_token_ids"])  # sees the document; stores its blocks at exit
    assert tokens == plain_outputs[0][0] and hits == 0
    tokens, hits = run(rounds[3][0]["prompt_token_ids"])  # a new process, another question
    assert tokens == plain_outputs[3][0] and hits == (DOC_LEN // 16) * 16


def _disk_llm(llama_dir, cache, **kw):
    return make_llm(llama_dir, **POOL, kv_disk_cache_dir=str(cache), **kw)


def test_corrupt_files_on_disk_mean_recompute(llama_dir, tmp_path, plain_outputs):
    llm = _disk_llm(llama_dir, tmp_path)
    rounds = _workload()
    assert _run(llm, rounds[:3]) == plain_outputs[:3]
    llm.llm_engine.core.kv_transfer.flush(5.0)
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs)
    for i, f in enumerate(files):  # damage every block file: flip bytes in some, truncate the others
        with open(f, "r+b") as fh:
            if i % 2:
                fh.truncate(HEADER_SIZE + 3)
            else:
                fh.seek(HEADER_SIZE + 1)
                fh.write(b"\x13\x37")
    assert _run(llm, rounds[3:]) == plain_outputs[3:]
    assert _tier_stats(llm)["disk"]["errors"] >= 1
    _check_idle(llm)


def test_directory_deleted_mid_run(llama_dir, tmp_path, plain_outputs):
    llm = _disk_llm(llama_dir, tmp_path)
    rounds = _workload()
    assert _run(llm, rounds[:3]) == plain_outputs[:3]
    llm.llm_engine.core.kv_transfer.flush(5.0)
    shutil.rmtree(tmp_path)
    assert _run(llm, rounds[3:]) == plain_outputs[3:]
    llm.llm_engine.core.kv_transfer.flush(5.0)
    assert _tier_stats(llm)["disk"]["blocks"] > 0  # the directory came back and holds new blocks
    _check_idle(llm)


def test_permission_denied(llama_dir, tmp_path, plain_outputs, monkeypatch):
    llm = _disk_llm(llama_dir, tmp_path)

    def denied(path, *a, **k):  # root ignores chmod, so refuse every open in the disk tier directly
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(disk_mod, "open", denied, raising=False)
    assert _run(llm, _workload()) == plain_outputs
    stats = _tier_stats(llm)["disk"]
    assert stats["errors"] > 0 and stats["blocks_stored"] == 0
    _check_idle(llm)


@pytest.fixture
def small_disk(tmp_path):
    """A 300 KiB tmpfs (a disk that fills for real), or a plain directory when mounting is not allowed."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)], capture_output=True)
    yield mnt, ok.returncode == 0
    if ok.returncode == 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_that_fills(llama_dir, small_disk, plain_outputs, monkeypatch):
    mnt, is_tmpfs = small_disk
    if not is_tmpfs:  # no mount permission: make writes past 300 KiB fail the way a full disk does
        real_write = disk_mod.DiskTier._write_atomic

        def full(self, path, data):
            if self._bytes + len(data) > 300 * 1024:
                raise OSError(28, "No space left on device", path)
            real_write(self, path, data)

        monkeypatch.setattr(disk_mod.DiskTier, "_write_atomic", full)
    llm = _disk_llm(llama_dir, mnt)
    assert _run(llm, _workload()) == plain_outputs
    llm.llm_engine.core.kv_transfer.flush(5.0)
    stats = _tier_stats(llm)["disk"]
    assert stats["errors"] > 0 and stats["capacity_bytes"] <= 300 * 1024  # the cap came down to the disk
    _check_idle(llm)


# -- the Redis tier --------------------------------------------------------------------------------------------
def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _RedisServer:
    def __init__(self):
        exe = shutil.which("redis-server")
        if exe is None:
            if os.environ.get("CI"):
                raise RuntimeError("redis-server is missing; .ci/run installs it with apt-get")
            pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
        self.exe, self.port, self.proc = exe, _free_port(), None

    def start(self):
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy",
                                      "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def redis_server():
    server = _RedisServer()
    server.start()
    yield server
    server.kill()


def test_a_slow_redis_costs_a_lookup_now_and_then_and_a_refused_write_one_block(redis_server):
    """Lookups run on the scheduler's thread: a server that answers, but slowly, has them skipped (misses) for
    retry_after_s, so it cannot slow every step. A write the server refuses (out of memory under noeviction)
    drops that block, not the server: reads go on."""
    import redis

    from tokenmill.kv.tiers.redis_tier import RedisTier
    tier = RedisTier(redis_server.url, FP, SHAPE, DT, retry_after_s=0.5)
    keys = [_key(i) for i in range(3)]
    tier.batched_put(keys, [_block(i) for i in range(3)])
    assert tier.batched_exists(keys) == 3
    real = tier.client.pipeline

    def slow_pipeline(*a, **k):
        pipe = real(*a, **k)
        execute = pipe.execute

        def slow_execute(*ea, **ek):
            time.sleep(0.2)
            return execute(*ea, **ek)
        pipe.execute = slow_execute
        return pipe
    tier.client.pipeline = slow_pipeline
    t0 = time.monotonic()
    assert tier.batched_exists(keys) == 3  # slow, but an answer
    assert [tier.batched_exists(keys) for _ in range(20)] == [0] * 20  # skipped: no wait
    assert time.monotonic() - t0 < 0.35
    time.sleep(0.5)
    tier.client.pipeline = real
    assert tier.batched_exists(keys) == 3  # tried again after retry_after_s
    admin = redis.Redis(port=redis_server.port)
    admin.config_set("maxmemory-policy", "noeviction")  # first: under allkeys-lru a 1-byte cap evicts all
    admin.config_set("maxmemory", "1")
    errors = tier.stats.errors
    tier.batched_put([_key(9)], [_block(9)])  # refused: OOM
    assert tier.stats.errors == errors + 1 and not tier.batched_exists([_key(9)])
    assert torch.equal(tier.get(_key(1)), _block(1))  # the server is not marked down
    admin.config_set("maxmemory", "64mb")
    admin.config_set("maxmemory-policy", "allkeys-lru")
    tier.close()


def test_a_redis_timeout_stops_only_its_own_side(redis_server):
    """A store that times out (a large pipeline on a busy link) drops stores for retry_after_s, but lookups and
    loads of the blocks already there go on (one breaker for both lost every hit); a read timeout leaves stores
    on. A connection error means the server is gone: both sides stop."""
    import redis

    from tokenmill.kv.tiers.redis_tier import RedisTier
    tier = RedisTier(redis_server.url, FP, SHAPE, DT, retry_after_s=30.0)
    keys = [_key(i) for i in range(2)]
    tier.batched_put(keys, [_block(i) for i in range(2)])
    real = tier.client.pipeline
    failure = [None]

    def failing_pipeline(*a, **k):
        pipe = real(*a, **k)
        execute = pipe.execute

        def run(*ea, **ek):
            if failure[0] is not None and any(cmd[0][0] == failure[0][0] for cmd in pipe.command_stack):
                raise failure[0][1]
            return execute(*ea, **ek)
        pipe.execute = run
        return pipe
    tier.client.pipeline = failing_pipeline
    failure[0] = ("SET", redis.TimeoutError("Timeout writing to socket"))
    tier.batched_put([_key(5)], [_block(5)])  # times out: stores off
    failure[0] = None
    tier.batched_put([_key(6)], [_block(6)])  # dropped without a call
    assert tier.batched_exists(keys) == 2 and torch.equal(tier.get(_key(1)), _block(1))  # reads go on
    assert tier.batched_exists([_key(6)]) == 0 and tier.stats.blocks_stored == 2
    tier._down_until["write"] = 0.0
    failure[0] = ("EXISTS", redis.TimeoutError("Timeout reading from socket"))
    assert tier.batched_exists(keys) == 0  # times out: reads off
    failure[0] = None
    assert tier.batched_exists(keys) == 0 and tier.get(_key(1)) is None
    tier.batched_put([_key(6)], [_block(6)])  # stores go on
    assert tier.stats.blocks_stored == 3
    tier._down_until["read"] = 0.0
    assert tier.batched_exists([_key(6)]) == 1
    for error in (redis.ConnectionError("Connection refused"), redis.TimeoutError("Timeout connecting to server")):
        tier._down_until = {"read": 0.0, "write": 0.0}
        failure[0] = ("EXISTS", error)  # (a connect that times out: a server out of reach, as a refusal)
        assert tier.batched_exists(keys) == 0
        failure[0] = None
        tier.batched_put([_key(7)], [_block(7)])  # the server is down for both sides
        assert tier.stats.blocks_stored == 3
    tier.close()


def test_greedy_identical_with_redis_hits_shared_by_two_engines(llama_dir, redis_server, plain_outputs):
    rounds = _workload()
    a = make_llm(llama_dir, **POOL, kv_remote_cache_url=redis_server.url)
    assert _run(a, rounds[:3]) == plain_outputs[:3]
    a.llm_engine.core.kv_transfer.flush(5.0)
    b = make_llm(llama_dir, **POOL, kv_remote_cache_url=redis_server.url)  # another replica
    assert _run(b, rounds[3:4]) == plain_outputs[3:4]
    assert _tier_stats(b)["remote"]["hit_tokens"] == (DOC_LEN // 16) * 16  # q3 then hit b's own pool
    _check_idle(a)
    _check_idle(b)


def test_redis_killed_mid_run_and_restarted(llama_dir, redis_server, plain_outputs, caplog):
    rounds = _workload()
    llm = make_llm(llama_dir, **POOL, kv_remote_cache_url=redis_server.url)
    remote = llm.llm_engine.core.kv.tiers.tiers[0]
    remote.retry_after_s = 0.2
    assert _run(llm, rounds[:3]) == plain_outputs[:3]
    llm.llm_engine.core.kv_transfer.flush(5.0)
    stored_before = remote.stats.blocks_stored
    redis_server.kill()
    assert _run(llm, rounds[3:6]) == plain_outputs[3:6]  # misses and dropped stores, no errors
    assert "reads and writes off" in caplog.text  # a dead server: both sides
    redis_server.start()  # empty again: stores resume, then hits
    time.sleep(0.3)
    assert _run(llm, rounds[6:]) == plain_outputs[6:]
    llm.llm_engine.core.kv_transfer.flush(5.0)
    assert remote.stats.blocks_stored > stored_before > 0  # stores resumed once the server was back
    _check_idle(llm)


def _garbage_redis(replies: dict[bytes, bytes]) -> int:
    """A loopback server that speaks just enough RESP to take commands, and answers each command named in
    `replies` with that reply (else +OK): a broken proxy or a server of another protocol. Returns its port."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def handle(conn):
        buf = b""
        with conn:
            while data := conn.recv(1 << 16):
                buf += data
                while buf.startswith(b"*") and buf.count(b"\r\n") >= 1 + 2 * int(buf[1:buf.index(b"\r\n")]):
                    lines = buf.split(b"\r\n")
                    n = int(lines[0][1:])
                    name = lines[2].upper()
                    buf = b"\r\n".join(lines[1 + 2 * n:])
                    conn.sendall(replies.get(name, b"+OK\r\n"))

    def serve():
        while True:
            threading.Thread(target=handle, args=(srv.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


@pytest.mark.parametrize("replies", [{b"HELLO": b"+OK\r\n"},  # a handshake reply redis-py cannot read
                                     {b"HELLO": b"-ERR unknown\r\n", b"EXISTS": b"$3\r\nabc\r\n",
                                      b"MGET": b":7\r\n", b"SET": b":abc\r\n"}],
                         ids=["handshake", "replies"])
def test_a_redis_that_answers_garbage_is_a_dead_one(llama_dir, plain_outputs, replies, caplog):
    """redis-py raises TypeError or AttributeError (not RedisError) on replies it cannot parse: the tier treats
    any failure as a server out of reach (misses, dropped stores, counted), and the engine keeps its tokens."""
    from tokenmill.kv.tiers.redis_tier import RedisTier
    port = _garbage_redis(replies)
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", FP, SHAPE, DT, retry_after_s=0.05)
    key, block = b"k" * 16, torch.zeros(SHAPE, dtype=DT)
    for _ in range(3):
        assert tier.batched_exists([key]) == 0 and tier.batched_get([key]) == []
        tier.batched_put([key], [block])
        time.sleep(0.06)
    assert tier.stats.errors > 0
    rounds = _workload()
    llm = make_llm(llama_dir, **POOL, kv_remote_cache_url=f"redis://127.0.0.1:{port}/0")
    assert _run(llm, rounds[:4]) == plain_outputs[:4]
    assert "reads and writes off" in caplog.text
    _check_idle(llm)


# -- configuration -------------------------------------------------------------------------------------------
def test_bad_tier_configuration_is_refused(llama_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_llm(llama_dir, kv_host_cache_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="redis://"):
        make_llm(llama_dir, kv_remote_cache_url="http://localhost:6379")
    with pytest.raises(ValueError, match="kv_cache_store_policy"):
        make_llm(llama_dir, kv_host_cache_gb=1, kv_cache_store_policy="sometimes")


# -- metrics -------------------------------------------------------------------------------------------------
def test_tier_metrics_reach_prometheus_and_the_bench_table(llama_dir, tmp_path):
    from tokenmill.bench.datasets import SampleRequest
    from tokenmill.bench.metrics import format_table
    from tokenmill.bench.offline import run_offline
    from tokenmill.engine.metrics import ServerMetrics

    rounds = _workload()
    llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05, kv_disk_cache_dir=str(tmp_path))
    _run(llm, rounds)  # the document's blocks reach the tiers
    llm.llm_engine.core.scheduler.kv.reset_prefix_cache()  # so the measured run must load it from them
    reqs = [SampleRequest(rounds[0][0], len(rounds[0][0]["prompt_token_ids"]), 4)]
    res = run_offline(reqs, engine=llm.llm_engine, ignore_eos=True, disable_tqdm=True, num_warmups=0)
    host = res["kv_cache"]["tiers"]["host"]  # (the run's counts: its own hits; occupancy as it stands)
    assert host["hit_tokens"] > 0 and host["blocks"] > 0
    table = format_table(res, ["ttft"], [50.0], "t")
    assert "KV tier: host" in table and "KV tier: disk" in table
    metrics = ServerMetrics("m")
    from tokenmill.engine.core import EngineStats

    metrics.set_engine_stats(EngineStats(1, 0, 20, 10, 0.5, 10, 5, 0.5, 0, 3, num_loading_kv=1,
                                         kv_tiers=res["kv_cache"]["tiers"]))
    text = metrics.render().decode()
    assert f'tokenmill:kv_tier_hit_tokens_total{{model_name="m",tier="host"}} {float(host["hit_tokens"])}' in text
    assert 'tokenmill:kv_tier_bytes{model_name="m",tier="disk"}' in text
    assert 'tokenmill:num_requests_loading_kv{model_name="m"} 1.0' in text
    assert 'tokenmill:kv_tier_stores_dropped_total{model_name="m",tier="disk"} 0.0' in text


def test_stores_the_lower_tiers_cannot_keep_up_with_are_dropped_and_counted(tmp_path):
    from tokenmill.sched.output import BlockStore
    from tokenmill.worker.kv_transfer import KVTransferWorker
    gate = threading.Event()

    class Stalled(DiskTier):  # a disk that has stopped keeping up
        def put(self, key, block):
            gate.wait(30)
            super().put(key, block)
    disk = Stalled(str(tmp_path), 1 << 20, FP, SHAPE, DT)
    kv = torch.zeros(SHAPE[0], 2, 8, *SHAPE[2:], dtype=DT)  # [layers, 2, blocks, block_size, heads, dim]
    xfer = KVTransferWorker(kv, TierChain([disk]), max_queued_stores=2)
    try:
        xfer.store([BlockStore(i % 8, _key(i)) for i in range(6)])  # one in the thread, two queued, three dropped
        assert disk.stats.stores_dropped >= 3 and disk.snapshot()["stores_dropped"] == disk.stats.stores_dropped
    finally:
        gate.set()
        xfer.close()


@pytest.mark.parametrize("kw", [dict(kv_host_cache_gb=float("inf")), dict(kv_host_cache_gb=float("nan")),
                                dict(kv_disk_cache_gb=float("nan")), dict(kv_load_timeout_s=float("nan"))])
def test_tier_sizes_that_are_not_numbers_are_refused_up_front(kw):
    """inf and nan passed the sign checks and failed after the weights loaded, with a traceback."""
    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="must be finite numbers"):
        EngineConfig(**kw)
