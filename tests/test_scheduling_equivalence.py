"""Every scheduling path gives the plain path's greedy tokens, and gives back every KV block."""
import pytest

from tokenmill import SamplingParams
from tokenmill.engine.request import RequestStatus
from conftest import make_llm, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LENGTHS = [1, 9, 16, 31, 48, 70]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts, sp=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    return _tokens(outs)


@pytest.fixture(scope="module")
def reference(llama_dir):
    prompts = random_prompts(LENGTHS, seed=10)
    llm = make_llm(llama_dir, max_num_seqs=1, enable_prefix_caching=False, max_num_batched_tokens=256)
    return prompts, _run(llm, prompts)


def test_continuous_batching_matches_one_at_a_time(llama_dir, reference):
    prompts, ref = reference
    assert _run(make_llm(llama_dir), prompts) == ref


@pytest.mark.parametrize("budget", [5, 16, 33])
def test_chunked_prefill_small_budget(llama_dir, reference, budget):
    prompts, ref = reference
    llm = make_llm(llama_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    assert _run(llm, prompts) == ref


def test_prefix_cache_hits_give_same_tokens(llama_dir):
    shared = random_prompts([40], seed=11)[0]
    tails = random_prompts([3, 16, 1, 25], seed=12)
    prompts = [shared + t for t in tails]
    plain = _run(make_llm(llama_dir, enable_prefix_caching=False), prompts)
    llm = make_llm(llama_dir, max_num_batched_tokens=64)
    first = _run(llm, prompts[:1])
    rest = _run(llm, prompts[1:])
    again = _run(llm, prompts)  # fully cached prompts: everything but the last token is a hit
    assert first + rest == plain
    assert again == plain
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 32 * 3 and 0 < stats.prefix_cache_hit_rate < 1


def test_prefix_cache_stats_count_each_prompt_once_however_long_it_waits(llama_dir):
    """Long prompts held back by max_long_partial_prefills are looked up every step they wait; the stats count
    the lookup that admits each one, so queries are the prompts' tokens and hits what admission found."""
    shared = random_prompts([48], seed=13)[0]
    prompts = [shared + t for t in random_prompts([20, 24, 28], seed=14)]
    llm = make_llm(llama_dir, max_num_batched_tokens=40, long_prefill_token_threshold=12, max_long_partial_prefills=1)
    _run(llm, prompts[:1])
    _run(llm, prompts[1:])
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_queries == sum(map(len, prompts))
    assert stats.prefix_cache_hits == 2 * 48  # the shared 48 tokens (three 16-token blocks) for each later prompt


def test_prefix_cache_hit_in_chunked_prefill_with_decodes(llama_dir, reference):
    prompts, ref = reference
    llm = make_llm(llama_dir, max_num_batched_tokens=7)
    assert _run(llm, prompts) == ref
    assert _run(llm, prompts) == ref
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


def test_preemption_under_tiny_cache(llama_dir, reference):
    prompts, ref = reference
    # 90 tokens per sequence at most -> 6 blocks; 16 blocks cannot hold the batch at once
    llm = make_llm(llama_dir, num_kv_blocks=16, max_model_len=96)
    assert _run(llm, prompts) == ref
    assert llm.llm_engine.get_stats().num_preemptions > 0


def test_preemption_with_priority_policy(llama_dir, reference):
    prompts, ref = reference
    llm = make_llm(llama_dir, num_kv_blocks=16, max_model_len=96, scheduling_policy="priority")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        priority=[len(prompts) - i for i in range(len(prompts))])
    assert _tokens(outs) == ref
    llm.llm_engine.check_invariants()


def test_requests_arriving_mid_run(llama_dir, reference):
    prompts, ref = reference
    eng = make_llm(llama_dir, max_num_batched_tokens=24).llm_engine
    pending = list(enumerate(prompts))
    results = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins every third step
            i, p = pending.pop(0)
            eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        for out in eng.step():
            if out.finished:
                results[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(prompts))] == ref
    eng.check_invariants()


def test_n_greater_than_one_shares_prompt_blocks(llama_dir):
    prompt = random_prompts([50], seed=13)[0]
    llm = make_llm(llama_dir)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0, max_tokens=8,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits == 2 * 48  # followers reuse the leader's 3 full blocks
    llm.llm_engine.check_invariants()


def test_abort_frees_blocks_and_others_continue(llama_dir, reference):
    prompts, ref = reference
    eng = make_llm(llama_dir).llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    eng.step()
    eng.step()
    eng.abort_request(["1", "3"])
    results = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
    assert sorted(results) == ["0", "2", "4", "5"]
    assert all(results[str(i)] == ref[i] for i in (0, 2, 4, 5))
    eng.check_invariants()


def test_max_model_len_ends_with_length(llama_dir):
    llm = make_llm(llama_dir, max_model_len=40)
    out = llm.generate({"prompt_token_ids": random_prompts([30])[0]},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_scheduler_never_exceeds_budget_or_seq_cap(llama_dir):
    eng = make_llm(llama_dir, max_num_batched_tokens=20, max_num_seqs=3, num_kv_blocks=20).llm_engine
    for i, p in enumerate(random_prompts([5, 30, 12, 60, 2, 44, 17], seed=14)):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    sched = eng.core.scheduler
    orig = sched.schedule

    def checked():
        out = orig()
        assert out.num_scheduled_tokens <= 20 and len(out.seqs) <= 3
        assert all(r.status == RequestStatus.RUNNING for r in sched.running)
        eng.core.kv.check_invariants()
        return out

    sched.schedule = checked
    finished = 0
    for _ in range(500):
        finished += sum(o.finished for o in eng.step())
        if not eng.has_unfinished_requests():
            break
    assert finished == 7
    eng.check_invariants()


@pytest.mark.parametrize("kw", [
    dict(batching="static"),
    dict(kv_layout="contiguous"),
    dict(attention_impl="eager"),
    dict(batching="static", kv_layout="contiguous", attention_impl="eager", cpu_linear_kernel="torch"),
], ids=["static", "contiguous", "eager", "all-baseline"])
def test_ladder_baseline_modes_give_the_same_tokens(llama_dir, reference, kw):
    prompts, ref = reference
    llm = make_llm(llama_dir, max_model_len=128, max_num_seqs=4, **kw)
    eng = llm.llm_engine
    if kw.get("batching") == "static":  # no request joins a running batch
        orig = eng.core.scheduler.schedule

        def checked():
            before = {r.request_id for r in eng.core.scheduler.running}
            out = orig()
            new = {s.request_id for s in out.seqs} - before
            assert not new or not before
            return out

        eng.core.scheduler.schedule = checked
    assert _run(llm, prompts) == ref
    if kw.get("kv_layout") == "contiguous":  # each request held one adjacent run of max_model_len
        assert eng.get_stats().prefix_cache_hits == 0


def test_contiguous_layout_reserves_max_model_len(llama_dir):
    eng = make_llm(llama_dir, max_model_len=128, kv_layout="contiguous").llm_engine
    eng.add_request("a", {"prompt_token_ids": random_prompts([5])[0]}, GREEDY)
    eng.step()
    ids = eng.core.kv.block_ids("a")
    assert len(ids) == 128 // 16 and ids == list(range(ids[0], ids[0] + len(ids)))
    eng.abort_request("a")
    eng.check_invariants()


def test_long_prefill_threshold_gives_the_same_tokens(llama_dir, reference):
    prompts, ref = reference
    llm = make_llm(llama_dir, max_num_batched_tokens=40, long_prefill_token_threshold=12)
    assert _run(llm, prompts) == ref
    llm = make_llm(llama_dir, max_num_batched_tokens=40, long_prefill_token_threshold=12, max_long_partial_prefills=1)
    assert _run(llm, prompts) == ref
    with pytest.raises(ValueError, match="max_long_partial_prefills needs long_prefill_token_threshold"):
        make_llm(llama_dir, max_long_partial_prefills=1)
    with pytest.raises(ValueError, match="max_long_partial_prefills must be >= 0"):
        make_llm(llama_dir, long_prefill_token_threshold=12, max_long_partial_prefills=-1)
