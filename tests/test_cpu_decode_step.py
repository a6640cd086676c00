"""The one-call C decode step (worker/cpu_decode_step.py, ops/cpu_decode.c) against the per-op path it
replaces: the same kernels in the same order, so greedy tokens and logprobs must be bit-identical, for
float32, bfloat16, int8 and AWQ weights, with a QKV bias, and for a draft model's own steps."""
from __future__ import annotations

import logging

import pytest

from awq_oracle import autoawq_linear_class, write_autoawq_checkpoint
from conftest import _llama, _qwen2, make_llm, random_prompts, save_random_model
from tokenmill import SamplingParams
from tokenmill.ops import cpu_decode
from tokenmill.spec_decode.ngram import NgramProposer

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="needs gcc and an x86-64 CPU with AVX2 + FMA")

# head_dim 32: the fused rotary kernel (and so the decode step) needs a multiple of 32
SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=2)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def _save(path: str, config, seed: int) -> str:
    save_random_model(path, config, seed)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-step")
    return {"llama": _save(str(root / "llama"), _llama(**SHAPE), 0),
            "qwen2": _save(str(root / "qwen2"), _qwen2(**SHAPE), 1)}  # Qwen2: QKV bias


def _run(path: str, prompts, params=GREEDY, **kw):
    llm = make_llm(path, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.core.runner
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], runner


def _assert_same(fast, eager):
    for (tok_f, lp_f), (tok_e, lp_e) in zip(fast, eager):
        assert tok_f == tok_e
        assert [{t: p.logprob for t, p in row.items()} for row in lp_f] == \
            [{t: p.logprob for t, p in row.items()} for row in lp_e]  # exact: same kernels, same order


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"),
                                        ("qwen2", "bfloat16")])
def test_bit_identical_to_the_per_op_path(dirs, arch, dtype):
    prompts = random_prompts([7, 1, 19])
    fast, runner = _run(dirs[arch], prompts, dtype=dtype, max_num_seqs=1)  # batch 1: every decode takes it
    # each request's decodes, and the one-token prompt's prefill (a one-token step too)
    assert runner.decode_step is not None and runner.decode_step.steps == 3 * (GREEDY.max_tokens - 1) + 1
    eager, eager_runner = _run(dirs[arch], prompts, dtype=dtype, max_num_seqs=1, enforce_eager=True)
    assert eager_runner.decode_step is None
    _assert_same(fast, eager)


def test_int8_weights(dirs):
    prompts = random_prompts([9, 4])
    fast, runner = _run(dirs["llama"], prompts, quantization="int8", max_num_seqs=1)
    assert runner.decode_step is not None and runner.decode_step.steps > 0
    _assert_same(fast, _run(dirs["llama"], prompts, quantization="int8", max_num_seqs=1, enforce_eager=True)[0])


@pytest.mark.skipif(autoawq_linear_class() is None, reason="autoawq is a test dependency")
def test_awq_int4_weights(dirs, tmp_path):
    awq = str(tmp_path / "awq")
    write_autoawq_checkpoint(dirs["llama"], awq, 32)
    prompts = random_prompts([9, 4])
    fast, runner = _run(awq, prompts, max_num_seqs=1)
    assert runner.decode_step is not None and runner.decode_step.steps > 0
    _assert_same(fast, _run(awq, prompts, max_num_seqs=1, enforce_eager=True)[0])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_batches_up_to_eight_rows_are_bit_identical(dirs, dtype):
    """Steps of 2-8 decode rows take it (few-row kernels); steps with a prefill chunk go op by op."""
    prompts = random_prompts([5, 30, 11, 3, 8, 2])
    fast, runner = _run(dirs["qwen2"], prompts, dtype=dtype, max_num_seqs=6)
    assert runner.decode_step.steps >= GREEDY.max_tokens - 2
    _assert_same(fast, _run(dirs["qwen2"], prompts, dtype=dtype, max_num_seqs=6, enforce_eager=True)[0])


@pytest.mark.parametrize("dtype,quantization", [("bfloat16", None), ("bfloat16", "int8"), ("float32", None)])
def test_batches_over_eight_rows_where_the_kernels_take_them(dirs, dtype, quantization):
    """On CPUs without AVX-512, bfloat16 linears (no fast bf16 GEMM) take the few-row kernels beyond 8 rows, in
    chunks of 8, and float32 ones everywhere (faster than oneDNN up to 32 rows without AVX-512, 16 with): 12-row
    decode steps then run in one C call, still bit-identical; elsewhere op by op."""
    prompts = random_prompts([6, 2, 9, 4, 3, 7, 5, 8, 1, 2, 6, 3])
    kw = dict(dtype=dtype, max_num_seqs=12, quantization=quantization)
    fast, runner = _run(dirs["llama"], prompts, **kw)
    step = runner.decode_step
    assert (step.steps > 0 and step.rows / step.steps > 8) if step.max_rows >= 12 else step.steps == 0
    _assert_same(fast, _run(dirs["llama"], prompts, enforce_eager=True, **kw)[0])


def test_more_rows_than_it_takes_go_op_by_op(dirs):
    rows = make_llm(dirs["llama"]).llm_engine.core.runner.decode_step.max_rows + 2
    prompts = random_prompts([4] * rows)
    fast, runner = _run(dirs["llama"], prompts, max_num_seqs=rows)
    assert runner.decode_step.steps == 0  # every decode step has more rows than it takes
    assert [t for t, _ in fast] == [t for t, _ in _run(dirs["llama"], prompts, max_num_seqs=rows,
                                                       enforce_eager=True)[0]]


@pytest.mark.parametrize("k", [3, 10])
def test_verification_rows_take_it_and_speculation_stays_lossless(dirs, k):
    """n-gram drafts on a repetitive prompt: each verifying step is 1 + k decode rows of one sequence (11 rows
    at k = 10: float32 linears take the few-row kernels up to 16 rows with AVX-512, 32 without)."""
    prompts = [[7, 8, 9, 10] * 6, [11, 12, 13] * 5]
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
            "adaptive": False}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = make_llm(dirs["llama"], speculative_config=spec, max_num_seqs=1)
    fast = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    runner = llm.llm_engine.core.runner
    step = runner.decode_step
    assert step.steps > 0 and step.rows > step.steps  # one sequence at a time: several rows = a verification
    assert step.max_rows >= 1 + k
    # greedy without logprobs: every step after each prompt's prefill verifies with the head and argmax in C
    assert runner.num_argmax_steps == llm.llm_engine.core.num_steps - len(prompts)
    stats = llm.llm_engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # accepted runs and rejections
    plain, _ = _run(dirs["llama"], prompts, params=params, max_num_seqs=1, enforce_eager=True)
    assert fast == [t for t, _ in plain]
    # with logprobs the rows go through the sampler's verification: the same tokens
    sampled, sampled_runner = _run(dirs["llama"], prompts, params=SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True, logprobs=1),
                                   speculative_config=spec, max_num_seqs=1)
    assert sampled_runner.num_argmax_steps == 0 and [t for t, _ in sampled] == fast


def test_draft_model_steps_take_it_and_speculation_stays_lossless(dirs, tmp_path):
    draft = _save(str(tmp_path / "draft"), _llama(**{**SHAPE, "num_hidden_layers": 1}), 2)
    prompts = random_prompts([6, 13])
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    fast, runner = _run(dirs["llama"], prompts, params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        speculative_config=spec, max_num_seqs=1)
    assert runner.proposer.decode_step is not None and runner.proposer.decode_step.steps > 0
    plain, _ = _run(dirs["llama"], prompts, params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                    max_num_seqs=1, enforce_eager=True)
    assert [t for t, _ in fast] == [t for t, _ in plain]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafting_in_one_call_proposes_what_the_step_by_step_loop_does(dirs, tmp_path, monkeypatch, dtype):
    """All k draft steps of a batch in one C call (catch-up rows, then single-token steps with the head and an
    argmax in C) against the Python loop over the same forwards: the same drafts, proposal by proposal,
    with several requests per step and a depth of its own for each."""
    from dataclasses import replace

    from tokenmill.spec_decode.draft_model import DraftModelProposer

    draft = _save(str(tmp_path / "draft"), _llama(**{**SHAPE, "num_hidden_layers": 1}), 3)
    prompts = random_prompts([6, 13, 9, 4])
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "adaptive": False}
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (17, 10, 14, 11)]
    proposals, calls = [], []
    orig_propose, orig_one_call = DraftModelProposer.propose_batch, DraftModelProposer._draft_in_one_call

    def propose(self, runner, items):  # each request drafts its own depth (1-4), as adaptive depth does
        items = [(replace(s, propose_k=min(s.propose_k, 1 + sum(map(ord, s.request_id)) % 4)), st)
                 for s, st in items]
        out = orig_propose(self, runner, items)
        proposals[-1].append(sorted(out.items()))
        return out

    def one_call(self, runner, catch_up, ks):
        got = orig_one_call(self, runner, catch_up, ks)
        calls.append((got is not None, ks))
        return got

    monkeypatch.setattr(DraftModelProposer, "propose_batch", propose)
    monkeypatch.setattr(DraftModelProposer, "_draft_in_one_call", one_call)
    tokens = []
    for one_call_on in (True, False):
        if not one_call_on:
            monkeypatch.setattr(DraftModelProposer, "_draft_in_one_call", lambda *a: None)
        proposals.append([])
        llm = make_llm(dirs["llama"], dtype=dtype, speculative_config=spec, max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    in_one_call = [ks for took, ks in calls if took]
    assert len(in_one_call) > 5 and any(len(ks) > 1 for ks in in_one_call)  # batches of requests drafted in C
    assert any(len(set(ks)) > 1 for ks in in_one_call)  # and depths that differ within one call
    assert proposals[0] == proposals[1]
    plain = make_llm(dirs["llama"], dtype=dtype, enforce_eager=True).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tokens[0] == tokens[1] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.parametrize("kw", [dict(enforce_eager=True), dict(cpu_linear_kernel="torch"),
                                dict(attention_impl="eager")])
def test_off_where_the_per_op_path_would_differ(dirs, kw):
    llm = make_llm(dirs["llama"], **kw)
    assert llm.llm_engine.core.runner.decode_step is None


def test_off_for_heads_the_rotary_kernel_does_not_take(model_dirs, caplog):
    """conftest's mistral model has head_dim 16: the per-op path rotates it in torch, so no C step."""
    with caplog.at_level(logging.DEBUG, logger="tokenmill"):
        llm = make_llm(model_dirs["mistral"][0])
    assert llm.llm_engine.core.runner.decode_step is None
    assert "fused C norm / rotary / SiLU kernels do not take these shapes" in caplog.text


def test_preemption_prefix_hits_and_chunked_prefill_stay_bit_identical(dirs):
    """A tight KV pool (preemptions), shared prefixes (cache hits) and a small token budget (chunked prefill):
    the C step only ever sees decode rows, so the tokens and logprobs match the per-op path exactly."""
    prompts = random_prompts([40, 40, 23, 61, 9], seed=3)
    prompts[1][:32] = prompts[0][:32]
    kw = dict(max_model_len=128, num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    runs = []
    for eager in (False, True):
        llm = make_llm(dirs["llama"], enforce_eager=eager, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        core = llm.llm_engine.core
        assert core.stats().num_preemptions > 0 and core.stats().prefix_cache_hits > 0
        assert eager or core.runner.decode_step.steps > 0
        llm.llm_engine.check_invariants()
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    _assert_same(*runs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bursts_of_decode_steps_give_the_tokens_of_single_steps(dirs, dtype):
    """num_scheduler_steps=6: requests queue behind max_num_seqs (no bursts while one waits), max_tokens and a
    stop token end bursts midway, and a request with logprobs makes its steps plain ones. Tokens, logprobs
    and finish reasons match single steps; every KV block comes back."""
    prompts = random_prompts([5, 17, 9, 30, 12], seed=5)
    base = dict(dtype=dtype, max_num_seqs=2)
    plain = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = make_llm(dirs["llama"], **base).generate([{"prompt_token_ids": prompts[0]}], plain, use_tqdm=False)
    stop = ref[0].outputs[0].token_ids[16]  # a token the first request makes mid-run
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=31, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)]
    runs = []
    for steps in (1, 6):
        llm = make_llm(dirs["llama"], num_scheduler_steps=steps, **base)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].finish_reason) for o in outs])
        llm.llm_engine.check_invariants()
        assert (llm.llm_engine.core.runner.num_bursts > 0) == (steps > 1)
    assert runs[0][0][2] == "stop" and len(runs[0][0][0]) < 40
    assert [(t, f) for t, _, f in runs[0]] == [(t, f) for t, _, f in runs[1]]
    assert runs[0][2][1] is not None and \
        [{t: p.logprob for t, p in row.items()} for row in runs[0][2][1]] == \
        [{t: p.logprob for t, p in row.items()} for row in runs[1][2][1]]


def test_bursts_fill_blocks_that_later_prompts_hit_in_the_prefix_cache(dirs):
    """KV written inside a burst is the sequence's: a second prompt made of the first's prompt and output hits
    the blocks the burst filled (registered when the next step allocates) and continues as single steps do."""
    prompt = random_prompts([7], seed=6)[0]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    results = []
    for steps in (1, 8):
        llm = make_llm(dirs["llama"], num_scheduler_steps=steps, block_size=16)
        first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        follow = prompt + first[:41]
        out = llm.generate([{"prompt_token_ids": follow}], params, use_tqdm=False)[0]
        assert out.num_cached_tokens >= 32
        # each request: its prefill step (one token), then 49 tokens in single steps or ceil(49 / 8) bursts
        assert llm.llm_engine.core.num_steps == 2 * (1 + (49 if steps == 1 else 7))
        results.append((first, out.outputs[0].token_ids))
        llm.llm_engine.check_invariants()
    assert results[0] == results[1]


def test_a_request_that_finishes_in_a_burst_leaves_its_blocks_in_the_prefix_cache(dirs):
    """The blocks a request's last burst filled are registered when it finishes (no next allocation does it):
    a follow-up made of its prompt and whole output hits as many blocks as after single steps, 48 of 51
    tokens. 10 prompt tokens, then bursts of 8 from position 10: the last (positions 42-49) fills block 2
    (32-47) with tokens it makes itself, so no allocation registered it."""
    prompt = random_prompts([10], seed=13)[0]
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    for steps in (1, 8):
        llm = make_llm(dirs["llama"], num_scheduler_steps=steps, block_size=16)
        first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        follow = llm.generate([{"prompt_token_ids": prompt + first}], params, use_tqdm=False)[0]
        assert follow.num_cached_tokens == 48, steps
        llm.llm_engine.check_invariants()


def test_bursts_run_while_requests_wait_for_a_seat(dirs):
    """One seat, three requests: the two waiting ones could not join anyway, so the running one bursts. Each
    request: its prefill step (one token), then 12 tokens in three bursts of four."""
    prompts = random_prompts([6, 11, 8], seed=7)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    runs = []
    for steps in (1, 4):
        llm = make_llm(dirs["llama"], num_scheduler_steps=steps, max_num_seqs=1)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        core = llm.llm_engine.core
        assert (core.num_steps, core.runner.num_bursts) == ((39, 0) if steps == 1 else (12, 9))
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]


def test_bursts_need_the_one_call_step_and_automatic_ones_join_speculation(dirs):
    llm = make_llm(dirs["llama"], num_scheduler_steps=4, enforce_eager=True)
    assert llm.llm_engine.core.scheduler.decode_steps == 1  # warned and ignored
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_llm(dirs["llama"], num_scheduler_steps=-1)
    auto = make_llm(dirs["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert auto.llm_engine.core.auto_burst is not None  # the offline default (0): bursts where nothing drafts
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        make_llm(dirs["llama"], num_scheduler_steps=4,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


class _AlwaysWrong(NgramProposer):
    def propose(self, request_id, prompt, output, k):
        return [1] * k  # token 1 is never the model's choice here


def _greedy_tokens(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_steps_where_no_request_drafts_run_as_bursts(dirs):
    """With speculation configured, a decode step whose requests plan no drafts may run as a burst of steps
    (the offline default, num_scheduler_steps=0): once an always-wrong proposer's depth falls to 0, the
    engine bursts, and the tokens are plain greedy's."""
    sp = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([20], seed=1)[0]}
    plain = _greedy_tokens(make_llm(dirs["llama"], max_model_len=256, num_scheduler_steps=1), [prompt], sp)
    llm = make_llm(dirs["llama"], max_model_len=256, speculative_config=NGRAM)
    llm.llm_engine.core.runner.proposer = _AlwaysWrong(1, 1)
    assert _greedy_tokens(llm, [prompt], sp) == plain
    llm.llm_engine.check_invariants()
    st = llm.llm_engine.get_stats()
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens == 0
    assert llm.llm_engine.core.runner.num_bursts > 0


def test_a_draft_model_catches_up_over_bursts(dirs, monkeypatch):
    """Depths forced to alternate between drafting and none: the draft model (the target itself, so every
    draft that sees the right context is accepted) falls behind over each burst and catches up over the
    burst's tokens before drafting again. Tokens are plain greedy's, drafts keep being accepted, every block
    goes back."""
    sp = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([14, 23], seed=3)]
    plain = _greedy_tokens(make_llm(dirs["llama"], max_model_len=256, num_scheduler_steps=1), prompts, sp)
    spec = {"method": "draft_model", "model": dirs["llama"], "num_speculative_tokens": 4, "adaptive": False}
    llm = make_llm(dirs["llama"], max_model_len=256, speculative_config=spec)
    policy, calls = llm.llm_engine.core.scheduler.spec, [0]
    fixed = policy.plan

    def alternate(rids):
        calls[0] += 1
        return fixed(rids) if calls[0] % 4 == 0 else {}

    monkeypatch.setattr(policy, "plan", alternate)
    assert _greedy_tokens(llm, prompts, sp) == plain
    llm.llm_engine.check_invariants()
    st = llm.llm_engine.get_stats()
    assert llm.llm_engine.core.runner.num_bursts > 0
    assert st.spec_num_draft_tokens > 0 and st.spec_acceptance_rate > 0.9


def test_stop_strings_inside_a_burst_cut_the_output_where_single_steps_stop(dirs, stop_cuts):
    """Requests with stop strings burst too: the output processor cuts a burst's tokens at the stop string and
    finishes the request, so text, tokens and finish reason are the single steps'; at least one stop string
    must have landed inside a burst (spied on the detokenizer), and every block goes back."""
    prompt = {"prompt_token_ids": random_prompts([12], seed=9)[0]}
    single, burst = (make_llm(dirs["llama"], num_scheduler_steps=n) for n in (1, 8))
    base = single.generate([prompt], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    params = [SamplingParams(temperature=0, max_tokens=60, stop=[base.text[i:i + 3]])
              for i in range(4, len(base.text) - 3, 5) if base.text[i:i + 3].strip()]
    assert len(params) >= 4
    for sp in params:
        a = single.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        b = burst.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                         a.stop_reason)
    assert burst.llm_engine.core.runner.num_bursts > 0
    assert any(c > 0 for c in stop_cuts), stop_cuts  # some stop string landed inside a burst
    burst.llm_engine.check_invariants()


def test_a_burst_ends_once_every_request_has_made_a_stop_token(dirs):
    """Stop tokens (EOS, stop_token_ids) end a burst's steps in the C call once every request still stepping has made one:
    no steps are run past them (counted by the one-call step), and the tokens are the single steps'."""
    prompts = random_prompts([6, 9], seed=11)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = make_llm(dirs["llama"], num_scheduler_steps=1).generate(
        [{"prompt_token_ids": p} for p in prompts], free, use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in ref]
    # request 0 stops on a token it first makes at index i0 >= 3, request 1 at i1 > i0 (stop ids join EOS's list)
    i0 = next(i for i in range(3, 40) if toks[0][i] not in toks[0][:i])
    i1 = next(i for i in range(i0 + 1, 40) if toks[1][i] not in toks[1][:i])
    params = [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[toks[0][i0]]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[toks[1][i1]])]
    llm = make_llm(dirs["llama"], num_scheduler_steps=16)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert [o.token_ids for o in outs] == [toks[0][:i0 + 1], toks[1][:i1 + 1]]
    assert [o.finish_reason for o in outs] == ["stop", "stop"]
    # one prefill step (a token each), then bursts that stop after the i1 steps request 1 needs (not 40)
    assert llm.llm_engine.core.runner.decode_step.steps == i1
    llm.llm_engine.check_invariants()


def test_automatic_bursts_fit_the_measured_step_time(dirs):
    """num_scheduler_steps=0 (the offline LLM's default): bursts as long as fit in AUTO_BURST_MS at the step
    time the engine measures, so a tiny model bursts and gives the tokens of single steps."""
    from tokenmill.sched.burst import AUTO_BURST_STEPS, AutoBurst

    burst = AutoBurst(budget_ms=4.0)
    assert burst.observe(0.010, 1) == 1  # a 10 ms step: no bursts
    assert all(burst.observe(0.0001 * 16, 16) >= 1 for _ in range(50)) and burst.observe(0.0016, 16) == AUTO_BURST_STEPS
    assert AutoBurst(budget_ms=4.0).observe(0.002, 2) == 4  # 1 ms per step
    prompts = random_prompts([5, 17, 9], seed=12)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    runs = []
    for steps in (1, None):
        llm = make_llm(dirs["llama"], num_scheduler_steps=steps)
        runs.append([o.outputs[0].token_ids for o in
                     llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)])
        core = llm.llm_engine.core
        assert (core.auto_burst is not None) == (steps is None)
        assert (core.runner.num_bursts > 0) == (steps is None)
        llm.llm_engine.check_invariants()
    assert runs[0] == runs[1]
    # the server's engine (built from EngineConfig, as the OpenAI server does) keeps single steps by default
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    served = LLMEngine(EngineConfig(model=dirs["llama"], dtype="float32", max_model_len=256)).core
    assert served.config.num_scheduler_steps == 1 and served.auto_burst is None and served.scheduler.decode_steps == 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_decode_steps_take_the_head_and_argmax_in_the_call(dirs, dtype):
    """A decode step whose every request would sample by an argmax of its raw logits runs the LM head and the
    argmax in the one C call too (a burst of one step). Requests with penalties, a seed or pending min_tokens
    keep the sampler; tokens match the per-op path's logits and sampler, one at a time and batched."""
    prompts = random_prompts([5, 13, 8, 21], seed=8)
    n = 12
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, min_tokens=5),
              SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True, seed=3)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    eager = make_llm(dirs["llama"], dtype=dtype, enforce_eager=True).generate(inputs, params, use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in eager]
    for seats in (1, 4):
        llm = make_llm(dirs["llama"], dtype=dtype, max_num_seqs=seats, num_scheduler_steps=1)  # steps, not bursts
        outs = llm.generate(inputs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        runner = llm.llm_engine.core.runner
        # one at a time: the first request's n - 1 decode steps, the second's once it has 5 tokens; batched, a
        # step holds a request that needs the sampler
        assert runner.num_argmax_steps == ((n - 1) + (n - 5) if seats == 1 else 0)
        llm.llm_engine.check_invariants()
    only_greedy = make_llm(dirs["llama"], dtype=dtype, max_num_seqs=4, num_scheduler_steps=1)
    outs = only_greedy.generate(inputs, params[0], use_tqdm=False)
    ref = make_llm(dirs["llama"], dtype=dtype, enforce_eager=True).generate(inputs, params[0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert only_greedy.llm_engine.core.runner.num_argmax_steps >= n - 1
