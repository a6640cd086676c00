"""Async scheduling (engine/core.py, worker/model_runner.py): step N+1 is scheduled and launched before step
N's tokens are back, its decode inputs filled in from step N's token tensor. Tokens, stops and KV accounting
are those of the plain engine, whatever the engine does meanwhile (chunked prefill, preemption, aborts)."""
import pytest

from tokenmill import SamplingParams
from conftest import make_llm, random_prompts

LENGTHS = [1, 9, 16, 31, 48, 70]


def _run(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].finish_reason for o in outs]


def _pair(llama_dir, prompts, sp, **kw):
    plain = make_llm(llama_dir, async_scheduling=False, **kw)
    overlap = make_llm(llama_dir, async_scheduling=True, **kw)
    ref, got = _run(plain, prompts, sp), _run(overlap, prompts, sp)
    core = overlap.llm_engine.core
    return ref, got, core


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=7), dict(num_kv_blocks=16, max_model_len=96)],
                         ids=["plain", "chunked", "preemption"])
def test_greedy_tokens_equal_the_plain_engine(llama_dir, eager, kw):
    prompts = random_prompts(LENGTHS, seed=40)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref, got, core = _pair(llama_dir, prompts, sp, enforce_eager=eager, **kw)
    assert got == ref
    assert core.scheduler.num_run_ahead > 0  # requests did join a step while the one before held them
    if eager:  # the sampler's tokens stayed on the device until the next step was launched
        assert core.runner.num_deferred_steps > 0
        assert core.runner.num_pending_fills[0] > 0  # the same requests in the same order: inputs by a slice
    if "num_kv_blocks" in kw:
        assert core.scheduler.num_preemptions > 0


def test_stops_and_lengths_drop_the_token_sampled_past_them(llama_dir):
    """A stop token ends a request whose next step is already in flight: that step's token is dropped, and
    max_tokens is never overrun (the scheduler knows lengths without the tokens)."""
    prompts = random_prompts(LENGTHS, seed=41)
    plain = make_llm(llama_dir, async_scheduling=False, enforce_eager=True)
    free_run, _ = _run(plain, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop = free_run[2][4]  # a token request 2 emits fifth: it stops there, and wherever else it occurs
    sps = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[stop], min_tokens=mn)
           for m, mn in zip([1, 2, 12, 12, 5, 12], [0, 0, 0, 6, 0, 0])]
    ref, got, core = _pair(llama_dir, prompts, sps, enforce_eager=True)
    assert got == ref
    tokens, reasons = ref
    assert tokens[2][-1] == stop and len(tokens[2]) <= 5 and reasons[2] == "stop"
    assert [len(t) for t in tokens[:2]] == [1, 2]
    assert len(tokens[3]) >= 6  # min_tokens holds the stop back
    assert core.runner.num_pending_fills[1] > 0  # requests left mid-batch: the next inputs are gathered


def test_seeded_sampling_and_penalties_reproduce(llama_dir):
    prompts = random_prompts(LENGTHS, seed=42)
    sps = [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=16, ignore_eos=True,
                          repetition_penalty=1.3 if i % 3 == 0 else 1.0, logprobs=2 if i == 4 else None)
           for i in range(len(prompts))]
    ref, got, core = _pair(llama_dir, prompts, sps, enforce_eager=True)
    assert got == ref
    assert core.scheduler.num_run_ahead > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_penalized_requests_run_ahead_and_count_their_token_still_on_the_device(llama_dir, temperature):
    """Every request penalized (repetition, presence, frequency; some with min_tokens): they run ahead, their
    last token still a placeholder, and the sampler counts it from the device. Large penalties make a token
    counted wrongly (or not at all) change the next choice."""
    prompts = random_prompts(LENGTHS, seed=44)
    sps = [SamplingParams(temperature=temperature, seed=3 + i, max_tokens=20, ignore_eos=True,
                          repetition_penalty=1.8 if i % 2 else 1.0, presence_penalty=1.5 if i % 3 else 0.0,
                          frequency_penalty=0.7, min_tokens=8 if i == 2 else 0)
           for i in range(len(prompts))]
    ref, got, core = _pair(llama_dir, prompts, sps, enforce_eager=True)
    assert got == ref
    assert core.scheduler.num_run_ahead > 0  # penalized requests joined the step after the one in flight


@pytest.mark.parametrize("kw", [dict(max_num_batched_tokens=7), dict(num_kv_blocks=16, max_model_len=96)],
                         ids=["chunked", "preemption"])
def test_penalized_requests_run_ahead_under_chunking_and_preemption(llama_dir, kw):
    prompts = random_prompts(LENGTHS, seed=45)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=1.5, repetition_penalty=1.3)
    ref, got, core = _pair(llama_dir, prompts, sp, enforce_eager=True, **kw)
    assert got == ref
    assert core.scheduler.num_run_ahead > 0
    if "num_kv_blocks" in kw:
        assert core.stats().num_preemptions > 0


def test_abort_while_a_step_is_in_flight_frees_everything(llama_dir):
    prompts = random_prompts(LENGTHS, seed=43)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref, _ = _run(make_llm(llama_dir, async_scheduling=False), prompts, sp)
    llm = make_llm(llama_dir, async_scheduling=True, enforce_eager=True)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    tokens: dict[str, list[int]] = {}
    for step in range(200):
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
        if step == 4:
            assert engine.core._deferred is not None  # a step's tokens are still on their way
            engine.abort_request(["r1", "r4"])
        if not engine.has_unfinished_requests():
            break
    engine.check_invariants()
    assert engine.core.kv.num_free_blocks == engine.core.kv.pool.num_blocks
    for i in (0, 2, 3, 5):
        assert tokens[f"r{i}"] == ref[i]


def test_config(llama_dir):
    llm = make_llm(llama_dir)
    assert llm.llm_engine.core.config.async_scheduling is False  # a CPU runs the model on the host's thread
    with pytest.raises(ValueError, match="async_scheduling does not run with speculative decoding"):
        make_llm(llama_dir, async_scheduling=True,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling does not run with pipeline parallelism"):
        make_llm(llama_dir, async_scheduling=True, pipeline_parallel_size=2, allow_cpu_oversubscription=True)


@pytest.mark.parametrize("tp, spec, asked, want", [
    (1, None, None, True),  # the CUDA default, measured on an H200
    (2, None, None, False),  # tensor parallelism: checked on CPU ranks only, so asked for, not the default
    (2, None, True, True),
    (1, '{"method": "ngram", "num_speculative_tokens": 2}', None, False),
])
def test_the_cuda_default(tp, spec, asked, want):
    from tokenmill.config import EngineConfig

    c = EngineConfig.__new__(EngineConfig)  # (resolving a CUDA config whole needs a GPU)
    c.__dict__.update(device="cuda", pipeline_parallel_size=1, tensor_parallel_size=tp, speculative_config=spec,
                      num_scheduler_steps=1, async_scheduling=asked)
    c._resolve_async_scheduling(None)
    assert c.async_scheduling is want


def test_generate_leaves_no_step_in_flight(llama_dir):
    """A request that stops on a token leaves a step sampled past it in flight; generate collects it, so the
    idle engine holds no block and no deferred step."""
    prompts = random_prompts(LENGTHS, seed=44)
    plain = make_llm(llama_dir, async_scheduling=False, enforce_eager=True)
    free_run, _ = _run(plain, prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    llm = make_llm(llama_dir, async_scheduling=True, enforce_eager=True)
    _run(llm, prompts, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[free_run[1][3]]))
    core = llm.llm_engine.core
    assert core._deferred is None and not core.has_unfinished()
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks


def test_a_reused_request_id_never_gets_the_token_of_the_step_before(llama_dir):
    """Request "a" stops while its next step is in flight, and a new request takes the id at once: the old
    step's token goes nowhere, and the new request's tokens are its own."""
    p1, p2 = random_prompts([12, 20], seed=45)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = make_llm(llama_dir, async_scheduling=False, enforce_eager=True)
    ref1, ref2 = (plain.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
                  for p in (p1, p2))
    engine = make_llm(llama_dir, async_scheduling=True, enforce_eager=True).llm_engine
    engine.add_request("a", {"prompt_token_ids": p1},
                       SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[ref1[2]]))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.core._deferred is not None  # the step after the stop is still in flight
    engine.add_request("a", {"prompt_token_ids": p2}, sp)
    out = None
    while engine.has_unfinished_requests():
        out = engine.step() or out
    assert out[0].outputs[0].token_ids == ref2
    engine.core.flush()
    engine.check_invariants()


def test_preemption_picks_the_victims_the_plain_engine_picks(llama_dir):
    """Under priority scheduling the lowest-priority requests are preempted, in flight or not."""
    prompts = random_prompts([5, 9, 16, 31, 48, 70], seed=40)

    def victims(async_scheduling: bool) -> list[str]:
        engine = make_llm(llama_dir, async_scheduling=async_scheduling, enforce_eager=True,
                          scheduling_policy="priority", num_kv_blocks=20, max_model_len=128).llm_engine
        sched, picked = engine.core.scheduler, []
        preempt = sched._preempt
        sched._preempt = lambda req, out: (picked.append(req.request_id), preempt(req, out))
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp, priority=0 if i < 3 else 5)
        while engine.has_unfinished_requests():
            engine.step()
        engine.core.flush()
        engine.check_invariants()
        return picked

    plain = victims(False)
    assert plain and victims(True) == plain


def _prompt_lps(rows):
    return [None if r is None else sorted((t, round(lp.logprob, 3)) for t, lp in r.items()) for r in rows]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_go_out_once_through_preemption(llama_dir, async_scheduling):
    """A preempted request prefills its prompt again; its prompt-logprob rows go out once, as without
    preemption (they went out twice: 139 rows for a 70-token prompt)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 9, 16, 31, 48, 70], seed=40)]
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    roomy = make_llm(llama_dir, enforce_eager=True, max_model_len=96).generate(prompts, sp, use_tqdm=False)
    llm = make_llm(llama_dir, async_scheduling=async_scheduling, enforce_eager=True, num_kv_blocks=16,
                   max_model_len=96)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for o, want, p in zip(outs, roomy, prompts):
        assert len(o.prompt_logprobs) == len(p["prompt_token_ids"])
        assert _prompt_lps(o.prompt_logprobs) == _prompt_lps(want.prompt_logprobs)


def test_a_reused_request_id_never_gets_the_prompt_logprobs_of_the_step_before(llama_dir):
    """Request "x" is aborted while its prefill chunk (with prompt logprobs) is in flight, and a new "x" takes
    the id: the old chunk's rows go nowhere (they were appended to the new request's)."""
    old, new, short = random_prompts([40, 30, 4], seed=7)
    want = make_llm(llama_dir, enforce_eager=True).generate(
        [{"prompt_token_ids": new}], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
    engine = make_llm(llama_dir, async_scheduling=True, enforce_eager=True, max_num_batched_tokens=8).llm_engine
    engine.add_request("y", {"prompt_token_ids": short}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.add_request("x", {"prompt_token_ids": old}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    for _ in range(3):
        engine.step()
    # x's chunk and its rows are in flight: on the device until the step is collected (no wait for it now)
    assert engine.core._deferred[1].deferred.prompt_logprobs.get("x") and not engine.core._deferred[1].prompt_logprobs
    engine.abort_request(["x"])
    engine.add_request("x", {"prompt_token_ids": new}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1))
    final = {}
    while engine.has_unfinished_requests():
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    engine.flush()
    engine.check_invariants()
    assert len(final["x"].prompt_logprobs) == len(new)
    assert _prompt_lps(final["x"].prompt_logprobs) == _prompt_lps(want[0].prompt_logprobs)


def test_flush_passes_a_stop_string_on_to_the_core(llama_dir):
    """LLMEngine.flush() between steps: a stop string matched in the flushed step's tokens finishes the request
    in the core too (the core ran it on to max_tokens, holding its blocks)."""
    p, = random_prompts([12], seed=3)
    plain = make_llm(llama_dir, enforce_eager=True)
    free = plain.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    stop = plain.get_tokenizer().decode(free.token_ids[3:4])
    engine = make_llm(llama_dir, enforce_eager=True, async_scheduling=True).llm_engine
    engine.add_request("a", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                    stop=[stop]))
    finished_at = None
    for k in range(40):
        outs = engine.flush() if k % 2 else engine.step()  # a caller that drains between steps
        if any(o.finished for o in outs):
            finished_at = k
            break
    assert finished_at is not None and finished_at < 20
    assert not engine.core.scheduler.requests  # the core let it go too
    engine.flush()
    engine.check_invariants()
    assert engine.core.kv.num_free_blocks == engine.core.kv.pool.num_blocks


@pytest.mark.parametrize("seed", [1, 6, 7])
def test_no_preemption_for_blocks_that_come_back_with_the_step_in_flight(llama_dir, seed):
    """Requests whose token in flight ends them by length still hold their blocks when the next step is
    scheduled; a request short of blocks waits a step for them rather than preempt another (which recomputes its
    whole context). On these workloads the plain engine preempts less than async scheduling did (0/1/0 against
    2/2/1): async now preempts no more, with the same tokens."""
    import random
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([rng.randint(5, 60) for _ in range(10)], seed=seed)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(3, 12), ignore_eos=True) for _ in prompts]
    runs = {}
    for a in (False, True):
        llm = make_llm(llama_dir, async_scheduling=a, enforce_eager=True, num_kv_blocks=16, max_model_len=96)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[a] = ([o.outputs[0].token_ids for o in outs], llm.llm_engine.core.scheduler.num_preemptions)
        llm.llm_engine.check_invariants()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] <= runs[False][1]
