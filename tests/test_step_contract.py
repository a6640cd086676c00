"""The core -> worker step contract is plain data (it serializes, holds no live references), the worker's
per-request state follows it exactly, and the scheduler takes several tokens per request per step."""
import pickle

import msgspec
import pytest

from tokenmill import SamplingParams
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from tokenmill.kv.manager import KVCacheManager
from tokenmill.sched.output import SchedulerOutput
from tokenmill.sched.scheduler import Scheduler
from conftest import make_llm, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _scheduler(num_blocks=64, block_size=4, budget=32, **kw):
    kv = KVCacheManager(num_blocks, block_size)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64, **kw)


def _request(rid, n_prompt, **params):
    sp = SamplingParams(**{"temperature": 0, "max_tokens": 8, "ignore_eos": True, **params})
    return Request(rid, list(range(10, 10 + n_prompt)), sp)


def test_scheduler_output_round_trips_through_pickle_and_msgpack():
    sched = _scheduler()
    for i, n in enumerate([5, 9, 30]):
        sched.add_request(_request(f"r{i}", n, seed=i, stop=["x"]))
    first = sched.schedule()
    sched.update(first, {s.request_id: [7] for s in first.seqs if s.num_sampled_positions})
    second = sched.schedule()  # cached requests: only new blocks, no prompt
    for out in (first, second):
        assert pickle.loads(pickle.dumps(out)) == out
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=SchedulerOutput) == out
    assert all(s.new_request is not None for s in first.seqs)
    assert all(s.new_request is None for s in second.seqs if s.request_id != "r2" or s.start_pos)


def test_scheduler_output_holds_copies_not_the_requests_lists():
    sched = _scheduler()
    req = _request("a", 6)
    sched.add_request(req)
    out = sched.schedule()
    new = out.seqs[0].new_request
    assert new.prompt_token_ids == req.prompt_token_ids and new.prompt_token_ids is not req.prompt_token_ids
    req.output_token_ids.append(99)  # later changes to the request do not reach a sent output
    assert new.output_token_ids == []
    sched.kv.req_blocks["a"].append(sched.kv.pool.allocate(1)[0])
    assert len(new.block_ids) == 2


def test_each_step_sends_only_the_new_blocks():
    sched = _scheduler(block_size=4, budget=4)
    sched.add_request(_request("a", 10))
    table = []
    for _ in range(4):
        out = sched.schedule()
        (seq,) = out.seqs
        table += seq.new_request.block_ids if seq.new_request else seq.new_block_ids
        assert table == sched.kv.block_ids("a")
        sched.update(out, {"a": [5]} if seq.num_sampled_positions else {})
    assert [s.num_sampled_positions for s in out.seqs] == [1]


def _run_step(sched):
    out = sched.schedule()
    sched.update(out, {s.request_id: [3] for s in out.seqs if s.num_sampled_positions})
    return out


def test_preempted_request_is_sent_again_whole():
    sched = _scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add_request(_request("a", 8, max_tokens=12))
    sched.add_request(_request("b", 8, max_tokens=12))
    while not (out := _run_step(sched)).preempted_ids:
        pass
    assert out.preempted_ids == ["b"]
    victim = sched.requests["b"]
    generated = list(victim.output_token_ids)
    assert generated
    while not (seq := next((s for s in _run_step(sched).seqs if s.request_id == "b"), None)):
        pass
    assert seq.new_request is not None  # (its start may skip blocks it left in the prefix cache)
    assert seq.start_pos + seq.num_new_tokens == 8 + len(generated)
    assert seq.new_request.output_token_ids == generated  # the worker rebuilds it from scratch
    assert seq.new_request.block_ids == sched.kv.block_ids("b")


def test_update_takes_several_tokens_and_stops_at_the_first_stop():
    sched = _scheduler()
    a = _request("a", 4, max_tokens=10, stop_token_ids=[42])
    b = _request("b", 4, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    touched = dict((r.request_id, toks) for r, toks in sched.update(out, {"a": [1, 42, 2, 3], "b": [4, 5, 6, 7]}))
    assert touched == {"a": [1, 42], "b": [4, 5, 6]}  # a: stop token; b: max_tokens
    assert a.output_token_ids == [1, 42] and a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 42
    assert b.output_token_ids == [4, 5, 6] and b.status == RequestStatus.FINISHED_LENGTH
    assert sched.schedule().finished_ids == ["a", "b"]


def test_worker_state_follows_the_engine_and_is_released(llama_dir):
    """Chunked prefill, prefix hits and preemption: greedy tokens match a roomy engine, and when everything
    has finished the worker holds no request state or generator."""
    prompts = random_prompts([40, 40, 23, 61, 9], seed=3)
    prompts[1][:32] = prompts[0][:32]  # a prefix hit
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)]
    batch = [{"prompt_token_ids": p} for p in prompts]
    ref = make_llm(llama_dir, max_model_len=128)
    tight = make_llm(llama_dir, max_model_len=128, num_kv_blocks=9, max_num_batched_tokens=24)
    for sp in params:
        want = [o.outputs[0].token_ids for o in ref.generate(batch, sp, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in tight.generate(batch, sp, use_tqdm=False)]
        assert got == want
    core = tight.llm_engine.core
    assert core.stats().num_preemptions > 0
    core.step()  # the last finished ids reach the worker with the next (empty) step
    assert len(core.runner.requests) == 0 and not core.runner.requests.generators
    tight.llm_engine.check_invariants()


def test_block_pool_reports_stores_evictions_and_resets():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    events = []
    kv.pool.subscribe(events.append)
    a = Request("a", [1, 2, 3, 4, 5], SamplingParams())
    assert kv.allocate_slots(a, 5)
    h0, h1 = a.block_hashes[:2]
    ids = kv.block_ids("a")
    assert events == [BlockStored(ids[0], h0, None), BlockStored(ids[1], h1, h0)]
    kv.free(a)  # freed tail first: the partial block, then h1's, then h0's
    events.clear()
    b = Request("b", [9, 9, 9], SamplingParams())
    assert kv.allocate_slots(b, 3)  # takes the two blocks at the front of the free queue
    assert events[0] == BlockRemoved(ids[1], h1) and len(events) == 2  # then b's own full block is stored
    kv.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared()


@pytest.mark.parametrize("extra", [("salt",), ("a", "b"), (b"img", 3)])
def test_block_hash_extra_keys_are_a_tuple(extra):
    from tokenmill.kv.hashing import hash_block

    plain = hash_block(None, [1, 2])
    assert hash_block(None, [1, 2], extra) not in (plain, hash_block(None, [1, 2], extra[:-1] + ("x",)))
    assert hash_block(None, [1, 2], ("ab",)) != hash_block(None, [1, 2], ("a", "b"))


def test_long_prefill_threshold_lets_a_short_prompt_start_behind_a_long_one():
    def steps_until_short_runs(**kw):
        sched = _scheduler(num_blocks=64, block_size=4, budget=16, **kw)
        sched.add_request(_request("long", 60))
        sizes = []
        out = _run_step(sched)
        sizes.append({s.request_id: s.num_new_tokens for s in out.seqs})
        sched.add_request(_request("short", 3))
        for step in range(1, 10):
            out = _run_step(sched)
            got = {s.request_id: s.num_new_tokens for s in out.seqs}
            sizes.append(got)
            if "short" in got:
                return step, sizes
        raise AssertionError(sizes)

    step, sizes = steps_until_short_runs()
    assert step == 3 and sizes[0] == {"long": 16}  # uncapped, the long prefill takes each step until its last
    step, sizes = steps_until_short_runs(long_prefill_token_threshold=8)
    assert step == 1 and sizes[0] == {"long": 8} and sizes[1] == {"long": 8, "short": 3}
    assert all(n <= 16 for s in sizes for n in [sum(s.values())])


def test_max_long_partial_prefills_lets_short_prompts_pass_a_second_document():
    """Two 60-token documents and a short prompt arrive together, budget 16, cap 8: without a limit both
    documents take the step and the short prompt waits; with max_long_partial_prefills=1 the second document
    waits (until the first has one chunk left) and the short prompt runs in the first step."""
    def first_steps(**kw):
        sched = _scheduler(num_blocks=64, block_size=4, budget=16, long_prefill_token_threshold=8, **kw)
        for rid, n in (("doc1", 60), ("doc2", 60), ("short", 3)):
            sched.add_request(_request(rid, n) if rid != "doc2" else
                              Request(rid, list(range(200, 260)), SamplingParams(temperature=0, max_tokens=4,
                                                                                 ignore_eos=True)))
        return [{s.request_id: s.num_new_tokens for s in _run_step(sched).seqs} for _ in range(9)]

    assert first_steps()[0] == {"doc1": 8, "doc2": 8}
    steps = first_steps(max_long_partial_prefills=1)
    assert steps[0] == {"doc1": 8, "short": 3}
    doc2_start = next(i for i, s in enumerate(steps) if "doc2" in s)
    assert doc2_start == 7  # doc1 had 60 - 7 * 8 = 4 tokens left: its last chunk
    assert all(set(s) <= {"doc1", "short"} for s in steps[:doc2_start])


def test_a_long_prompt_starts_only_when_the_pool_holds_all_of_it():
    """Two 40-token prompts, a pool of 15 four-token blocks (room for one and a half), chunks of 8: the second
    waits for the first to finish instead of both prefilling, and preempting each other, in turns."""
    sched = _scheduler(num_blocks=15, block_size=4, budget=8)
    sched.add_request(_request("a", 40, max_tokens=4))
    sched.add_request(Request("b", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    seen = []
    for _ in range(40):
        out = _run_step(sched)
        seen.append(sorted(s.request_id for s in out.seqs))
        if not sched.num_unfinished:
            break
    assert not sched.num_unfinished and sched.num_preemptions == 0
    first_b = next(i for i, ids in enumerate(seen) if "b" in ids)
    assert all(ids == ["a"] for ids in seen[:first_b]) and "a" not in seen[first_b]


def test_a_short_prompt_passes_a_long_one_that_waits_for_room():
    sched = _scheduler(num_blocks=15, block_size=4, budget=8)
    sched.add_request(_request("a", 40, max_tokens=4))
    _run_step(sched)
    sched.add_request(Request("b", list(range(100, 140)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    sched.add_request(Request("c", [7, 8, 9], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    sched.add_request(Request("d", list(range(200, 220)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    for _ in range(8):  # a's prefill takes each step's budget; then c (3 tokens, one step) passes b, d (20) does not
        out = _run_step(sched)
        ids = {s.request_id for s in out.seqs}
        assert "b" not in ids and "d" not in ids
        if "c" in ids:
            break
    assert "c" in ids and sched.num_preemptions == 0


def test_decode_rows_fast_path_builds_what_the_general_path_builds(llama_dir):
    """Steps of decode rows only (plain decodes, n-gram verifications) are prepared from plain lists
    (`_prepare_decodes`); on every such step the numpy path (`_prepare_mixed`) must build the same inputs."""
    import torch

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
            "adaptive": False}
    llm = make_llm(llama_dir, speculative_config=spec, max_num_seqs=3)
    runner = llm.llm_engine.core.runner
    fast_path, checked = runner._prepare_decodes, []

    def both(seqs, states, graphs=None):
        fast = fast_path(seqs, states, graphs)
        slow = runner._prepare_mixed(seqs, states)
        for a, b in zip(fast[:2], slow[:2]):
            assert torch.equal(a, b)
        fb, sb = fast[2], slow[2]
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            assert torch.equal(getattr(fb, name), getattr(sb, name)), name
        assert (fb.num_decodes, fb.max_seq_len, fb.max_query_len, fb.query_start_loc_host, fb.seq_lens_host) == \
            (sb.num_decodes, sb.max_seq_len, sb.max_query_len, sb.query_start_loc_host, sb.seq_lens_host)
        assert fast[3] == slow[3]
        checked.append(fb.num_decodes > len(seqs))  # True where a sequence verified drafts
        return fast

    runner._prepare_decodes = both
    prompts = [[7, 8, 9, 10] * 6, [11, 12, 13] * 5, random_prompts([9])[0]]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert checked and any(checked) and not all(checked)


def _check_block_tables(runner) -> None:
    """Every live request's row of the persistent block-table array holds exactly its block_ids, zeros after."""
    tables, rows = runner.requests.tables, set()
    for st in runner.requests.states.values():
        assert st.table_row not in rows
        rows.add(st.table_row)
        n = len(st.block_ids)
        assert tables.array[st.table_row, :n].tolist() == st.block_ids
        assert not tables.array[st.table_row, n:].any()
    for row in set(range(tables.array.shape[0])) - rows:  # free rows are all zeros
        assert not tables.array[row].any()


def test_persistent_block_tables_follow_every_step(llama_dir):
    """The block tables a step reads come from one array updated in place (worker/request_state.py BlockTables):
    through tables past its first 16 columns, preemptions and resumptions
    (a KV cache of 60 blocks of 4 for 20 requests), finished rows reused, and the same greedy tokens as a run
    with room for all."""
    prompts = random_prompts([9, 30, 3, 17, 25] * 4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = make_llm(llama_dir, block_size=4, max_num_seqs=20, max_model_len=80)
    expected = [o.outputs[0].token_ids for o in reference.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = make_llm(llama_dir, block_size=4, num_kv_blocks=60, max_num_seqs=20, max_model_len=80)
    runner = llm.llm_engine.core.runner
    execute, widths = runner.execute, []

    def checked(sched):
        _check_block_tables(runner)
        out = execute(sched)
        _check_block_tables(runner)
        widths.append(runner.requests.tables.array.shape)
        return out

    runner.execute = checked
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == expected
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert max(w for _, w in widths) > 16  # the tables outgrew the array's first width
    _check_block_tables(runner)


def test_block_tables_grow_reuse_rows_and_gather_like_lists():
    """BlockTables against plain lists over random appends, clears and frees: rows past the first 16, widths
    past 16 columns, freed rows reused; gather gives the lists (zero-padded), repeated and unordered rows too."""
    import random

    from tokenmill.worker.request_state import BlockTables
    rng, tables, live, most_live = random.Random(0), BlockTables(), {}, 0
    for _ in range(3000):
        most_live = max(most_live, len(live))
        op = rng.random()
        if op < 0.2 or not live:
            row = tables.new_row()
            assert row not in live
            live[row] = []
            blocks = [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 5))]
            tables.write(row, 0, blocks)
            live[row] = blocks
        elif op < 0.75:
            row = rng.choice(list(live))
            new = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6))]
            tables.write(row, len(live[row]), new)
            live[row] += new
        elif op < 0.85:
            row = rng.choice(list(live))
            tables.clear(row, len(live[row]))
            live[row] = []
        else:
            row = rng.choice(list(live))
            tables.free(row, len(live.pop(row)))
        if live:
            rows = [rng.choice(list(live)) for _ in range(rng.randrange(1, 6))]
            if rng.random() < 0.5:
                rows = sorted(set(rows))
            width = max(len(live[r]) for r in rows)
            want = [live[r] + [0] * (width - len(live[r])) for r in rows]
            assert tables.gather(rows, width).tolist() == want
    assert 16 < tables.array.shape[0] <= 2 * most_live and tables.array.shape[1] > 16  # freed rows are reused
    for row, blocks in live.items():
        assert tables.array[row, :len(blocks)].tolist() == blocks and not tables.array[row, len(blocks):].any()
