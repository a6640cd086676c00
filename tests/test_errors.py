"""Bad input gets a ValueError naming the field; the engine keeps serving."""
import pytest

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from conftest import make_llm, random_prompts


@pytest.mark.parametrize("kw,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(seed="x"), "seed"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=2**70), "top_k"), (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(seed=2**80), "seed"), (dict(max_tokens=2**40), "max_tokens"), (dict(n=True), "n"),
    (dict(max_tokens=True), "max_tokens"),
])
def test_invalid_sampling_values(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_extreme_but_valid_values_do_not_crash(llama_dir):
    llm = make_llm(llama_dir)
    sp = SamplingParams(n=2, temperature=1.0, seed=2**64 - 1, top_k=2**31 - 1, max_tokens=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": random_prompts([4])[0]}, sp, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3]
    llm.llm_engine.check_invariants()


def test_bad_prompts_leave_engine_serving(llama_dir):
    llm = make_llm(llama_dir, max_model_len=64)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    good = {"prompt_token_ids": random_prompts([5])[0]}
    expected = llm.generate(good, sp, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt.*empty"):
        llm.generate("", sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt.*empty"):
        llm.generate({"prompt_token_ids": []}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [5] * 65}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [5, 10**6]}, sp, use_tqdm=False)
    # min_tokens masks the stop ids in the logits: one past the vocabulary (never sampled) once failed the whole
    # step (on a GPU, a device-side assert that ends the CUDA context); now it is simply never met
    far = SamplingParams(temperature=0, min_tokens=2, max_tokens=4, ignore_eos=True, stop_token_ids=[10**6])
    assert llm.generate(good, far, use_tqdm=False)[0].outputs[0].token_ids == expected
    # a bad prompt inside a batch rejects the batch but leaves nothing half-admitted
    with pytest.raises(ValueError):
        llm.generate([good, {"prompt_token_ids": []}], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(good, sp, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_config_errors_name_the_problem(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="model directory not found"):
        EngineConfig(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        make_llm(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        make_llm(str(tmp_path))
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(llama_dir, max_model_len=10**6)
    with pytest.raises(ValueError, match="dtype"):
        make_llm(llama_dir, dtype="int3")


def test_missing_weights_file(llama_dir, tmp_path):
    import shutil
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{llama_dir}/{f}", tmp_path / f)
    with pytest.raises(ValueError, match="model.safetensors"):
        make_llm(str(tmp_path))
    llm = make_llm(str(tmp_path), load_format="dummy")  # dummy weights need no checkpoint
    out = llm.generate("To be", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("structured", [False, True])
def test_a_request_the_core_refuses_halfway_leaves_nothing_behind(llama_dir, structured):
    """n = 2 whose second child id is taken (by an earlier request named like it): the first child must not
    stay in the core, running with no one to read it. Structured requests wait for their grammar outside the
    scheduler: the core must refuse the taken id there too (it replaced the waiting request)."""
    from tokenmill.sampling_params import StructuredOutputsParams

    llm = make_llm(llama_dir)
    engine = llm.llm_engine
    kw = dict(temperature=0, max_tokens=2, ignore_eos=True)
    if structured:
        kw["structured_outputs"] = StructuredOutputsParams(regex="[ab]+")
    prompt = {"prompt_token_ids": random_prompts([4])[0]}
    engine.add_request("x#1", prompt, SamplingParams(**kw))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", prompt, SamplingParams(n=2, **kw))
    core = engine.core
    assert set(core.scheduler.requests) | set(core.grammar_wait.waiting) == {"x#1"}
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["x#1"]
    assert len(outs[-1].outputs[0].token_ids) == 2
    llm.llm_engine.check_invariants()


def _step_fails_once(engine, owner, name: str, message: str) -> None:
    """One engine step in which `owner.name` raises RuntimeError(message)."""
    real = getattr(owner, name)

    def broken(*args):
        raise RuntimeError(message)
    setattr(owner, name, broken)
    try:
        with pytest.raises(RuntimeError, match=message):
            engine.step()
    finally:
        setattr(owner, name, real)


@pytest.mark.parametrize("where", ["execute", "collect"])
def test_a_failed_step_leaves_no_request_marked_in_flight(llama_dir, where):
    """The model raises in a step (or, under async scheduling, while its tokens are collected: where a device
    error shows); the server's core then aborts what the steps held (core_proc.py). A request that reuses one
    of those ids must run: the id stayed marked in flight, so it was never scheduled again. The runner must drop
    the lost step's token placeholders with the aborted requests (every later step looked them over)."""
    from tokenmill import SamplingParams

    engine = make_llm(llama_dir, enforce_eager=True, async_scheduling=where == "collect").llm_engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, sp)
    runner = engine.core.runner
    if where == "collect":
        engine.step()  # the prefill is in flight
    _step_fails_once(engine, runner, where, "CUDA error: an illegal memory access was encountered")
    assert engine.core._deferred is None
    engine.abort_request(["a"])
    assert not engine.core.scheduler.in_flight
    engine.step()  # (the lost step's placeholders are dropped with its requests, never collected)
    assert not runner._pending
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, sp)
    out = []
    for _ in range(20):
        out += [o for o in engine.step() if o.finished]
        if not engine.has_unfinished_requests():
            break
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 4
    engine.check_invariants()


@pytest.mark.parametrize("where", ["execute", "collect", "schedule"])
def test_a_failed_step_leaves_no_uncomputed_block_in_the_prefix_cache(llama_dir, where):
    """Blocks are registered in the prefix cache when a step is scheduled (their tokens are known). When the
    step then fails (the model raises, under async scheduling while its tokens are collected, or the schedule
    itself raises after planning: a tier lookup), their KV is never written: the same prompt again must not hit
    them (it got wrong tokens), and the tiers must not keep them."""
    prompt = random_prompts([120], seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(num_kv_blocks=40, max_num_batched_tokens=32)
    if where == "collect":  # (the per-op path: the CPU's one-call greedy steps return their tokens at once)
        kw.update(async_scheduling=True, enforce_eager=True)
    want = make_llm(llama_dir, **kw).generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    llm = make_llm(llama_dir, **kw)
    engine = llm.llm_engine
    core = engine.core
    engine.add_request("a", {"prompt_token_ids": prompt}, sp)
    engine.step()  # the first 32 tokens
    while where == "collect" and core._deferred is None:  # async: the last chunk (96 .. 119: block 6) in flight
        engine.step()
    if where == "schedule":  # a planning step that raises once the running request's blocks are registered
        _step_fails_once(engine, core.scheduler, "_plan_drafts", "injected failure")
    else:
        _step_fails_once(engine, core.runner, where, "injected failure")
    engine.abort_request(["a"])  # as the server's core and LLM.generate do after a failed step
    engine.step()
    got = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens <= (96 if where == "collect" else 32)  # what ran before the failure
    engine.check_invariants()


def _run_with_a_failed_step(llm, prompts: dict, fail_at, owner_name: str, name: str, abort=()) -> dict:
    """Greedy tokens per request id, where engine step `fail_at` (or the first step where `fail_at(core)`)
    fails (`owner.name` raises) and the caller carries on, aborting only `abort`."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for rid, p in prompts.items():
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    outs, n, failed = {}, 0, False
    while engine.has_unfinished_requests():
        n += 1
        if not failed and (n == fail_at if isinstance(fail_at, int) else fail_at(engine.core)):
            failed = True
            owner = engine.core.scheduler if owner_name == "scheduler" else engine.core.runner
            _step_fails_once(engine, owner, name, "injected failure")
            engine.abort_request(list(abort))
            continue
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    engine.check_invariants()
    return outs


@pytest.mark.parametrize("case", ["execute", "prepare", "collect", "collect-after-abort", "shared-hit", "drafts"])
def test_the_engine_carries_on_after_a_failed_step_with_the_plain_tokens(llama_dir, case):
    """A failed step is rolled back whole: the scheduler's counts, the worker's copy of each request (sent
    again whole), and the prefix cache's blocks that step registered, whoever holds them now (a request that
    hit them in that same step recomputes them; one aborted while the step was in flight freed them hashes
    and all). So a caller that carries on without aborting gets the plain engine's tokens, and one that
    aborted a request while its step was in flight leaves no uncomputed block to hit."""
    long, short = random_prompts([120, 40], seed=5)
    prompts, kw, fail = {"a": long}, dict(num_kv_blocks=40, max_num_batched_tokens=32), (2, "runner", "execute")
    abort = ()
    if case == "prepare":  # after the worker applied the step's diff
        fail = (2, "runner", "prepare_batch")
    elif case.startswith("collect"):  # async scheduling: a device error shows when the tokens are collected
        kw.update(async_scheduling=True, enforce_eager=True)
        fail = (5, "runner", "collect")
        abort = ("a",) if case == "collect-after-abort" else ()
    elif case == "shared-hit":  # b hits the blocks a registers in the same (failed) step; a is aborted
        prompts = {"a": short, "b": short[:32] + random_prompts([40], seed=9)[0]}
        kw["max_num_batched_tokens"], fail, abort = 128, (1, "runner", "execute"), ("a",)
    elif case == "drafts":  # the schedule raises after fitting drafts: none may reach a later step
        prompts = {"a": random_prompts([20], seed=3)[0] * 3, "b": random_prompts([30], seed=4)[0]}
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 4, "adaptive": False}
        fail = (lambda core: any(r.spec_token_ids for r in core.scheduler.requests.values()), "scheduler",
                "_plan_drafts")
    want = _run_with_a_failed_step(make_llm(llama_dir, **kw), prompts, 0, "runner", "execute")
    llm = make_llm(llama_dir, **kw)
    if case == "collect-after-abort":  # a is aborted while the lost step is in flight, then the collect fails
        engine = llm.llm_engine
        engine.add_request("a", {"prompt_token_ids": long}, SamplingParams(temperature=0, max_tokens=8))
        while engine.core._deferred is None:
            engine.step()
        engine.abort_request(["a"])
        _step_fails_once(engine, engine.core.runner, "collect", "injected failure")
        got = llm.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=8,
                                                                        ignore_eos=True), use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want["a"] and got.num_cached_tokens <= 96
        return
    got = _run_with_a_failed_step(llm, prompts, *fail, abort=abort)
    assert got == {rid: t for rid, t in want.items() if rid not in abort}


def test_the_offline_apis_boundary_gives_value_errors(llama_dir):
    """Malformed prompts, conversations and priority lists: a ValueError each (they were raw TypeErrors,
    AttributeErrors and IndexErrors from inside), and the engine keeps serving."""
    llm = make_llm(llama_dir)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for bad in (None, 5):
        with pytest.raises(ValueError, match="prompts must be"):
            llm.generate(bad, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_token_ids": None}, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], sp, use_tqdm=False, priority=[1])
    for bad in ("hello", ["hi"], [], [{"content": "no role"}]):
        with pytest.raises(ValueError, match="messages must be"):
            llm.chat(bad, sp, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template failed"):
        llm.chat([{"role": "user", "content": "x"}], sp, use_tqdm=False, chat_template="{{ messages[0].nope() }}")
    assert len(llm.generate((5, 6, 7), sp, use_tqdm=False)) == 1  # a tuple of ids is one prompt
    out = llm.chat([{"role": "user", "content": "x"}], sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    llm.llm_engine.check_invariants()


def test_the_offline_api_takes_what_vllms_does(llama_dir):
    """What a vLLM user passes offline: text parts in a text model's chat (they failed in the template), a
    tuple of params, lora_request=None, detokenize=False and vLLM's other params; booleans where numbers go
    are refused up front (logprobs=True failed the whole batch's step), and a priority the FCFS scheduler would
    ignore is refused, as the server and vLLM refuse it."""
    llm = make_llm(llama_dir)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                     sp, use_tqdm=False)[0]
    joined = llm.chat([{"role": "user", "content": "a\nb"}], sp, use_tqdm=False)[0]
    assert parts.prompt_token_ids == joined.prompt_token_ids and parts.outputs[0].text == joined.outputs[0].text
    with pytest.raises(ValueError, match="text parts only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], sp,
                 use_tqdm=False)
    outs = llm.generate([[5, 6], [7, 8]], (sp, sp), use_tqdm=False, lora_request=None)
    raw = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, detokenize=False,
                                                logprobs=1, spaces_between_special_tokens=False,
                                                extra_args={"tag": 1}), use_tqdm=False)[0].outputs[0]
    assert raw.token_ids == outs[0].outputs[0].token_ids and raw.text == ""
    assert all(lp.decoded_token is None for row in raw.logprobs for lp in row.values())
    for bad in (dict(logprobs=True), dict(prompt_logprobs=True), dict(top_k=True), dict(min_tokens=True),
                dict(stop_token_ids=[True]), dict(detokenize=False, stop=["x"]), dict(detokenize=0)):
        with pytest.raises(ValueError, match="invalid sampling parameter"):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="LoRA"):
        llm.generate([[5, 6]], sp, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate([[5, 6], [7, 8]], sp, use_tqdm=False, priority=[1, 0])
    assert len(llm.generate([[5, 6], [7, 8]], sp, use_tqdm=False, priority=[0, 0])) == 2
    llm.llm_engine.check_invariants()
