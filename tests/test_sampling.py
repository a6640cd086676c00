"""Sampler: seeds, filters, the softmax law, penalties, logprobs, stop rules."""
import math

from dataclasses import replace

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.sample.sampler import SampleRow, Sampler, filter_logits
from conftest import make_llm, random_prompts


def _rows(n, **kw):
    return [SampleRow(SamplingParams(**kw), [], [], None) for _ in range(n)]


def test_seeded_request_reproduces_whatever_the_batch(llama_dir):
    llm = make_llm(llama_dir)
    prompts = random_prompts([12, 30, 5], seed=20)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded, other, other], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": prompts[0]}, different, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.3), dict(min_p=0.2)])
def test_filters_never_emit_excluded_tokens(kw):
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    probs = logits.softmax(-1)
    if "top_k" in kw:
        allowed = [set(r.topk(kw["top_k"]).indices.tolist()) for r in logits]
    elif "top_p" in kw:
        allowed = []
        for r in probs:
            p, idx = r.sort(descending=True)
            keep = (p.cumsum(0) - p) < kw["top_p"]
            allowed.append(set(idx[keep].tolist()))
    else:
        allowed = [set((r >= kw["min_p"] * r.max()).nonzero().flatten().tolist()) for r in probs]
    sampler = Sampler(seed=0)
    seen = [set() for _ in range(4)]
    for _ in range(300):
        out = sampler(logits.clone(), _rows(4, temperature=1.0, **kw))
        for i, t in enumerate(out.token_ids):
            seen[i].add(t)
    for i in range(4):
        assert seen[i] <= allowed[i]
        assert len(seen[i]) > 1 or len(allowed[i]) == 1


def test_min_p_applies_before_top_p_as_in_vllm_v1():
    """probs [.4, .3, .2, .1], top_p .5, min_p .6: min_p keeps {0, 1} (.3 >= .6 x .4), renormalized to
    [.57, .43]; top_p .5 then keeps token 0 alone. The other order (top_p first) kept {0, 1}."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([0.5]), torch.tensor([0.6]), False, True, True)
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.6]), False, False, True)
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]


def test_temperature_sampling_follows_softmax():
    """Chi-square goodness of fit of 20k draws against softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -2.0]])
    temp = 0.7
    expected = (logits / temp).softmax(-1)[0]
    sampler = Sampler(seed=123)
    n = 20000
    rows = _rows(1, temperature=temp)
    counts = torch.zeros(6)
    batch = 500
    for _ in range(n // batch):
        out = sampler(logits.expand(batch, -1).clone(), rows * batch)
        counts += torch.bincount(torch.tensor(out.token_ids), minlength=6)
    chi2 = float((((counts - n * expected) ** 2) / (n * expected)).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p < 0.001 critical value


@pytest.mark.parametrize("case", ["every row top-k", "top-p, candidates hold it", "top-p, sort needed",
                                  "mixed rows", "a top-k past the candidates", "narrow vocabulary"])
def test_filters_from_the_heads_of_rows_equal_the_whole_sort(case):
    """filter_logits given the rows' settings on the host reads each row's W largest logits (topk) instead of
    sorting the vocabulary: the kept tokens and their logits must be the sort's (`_sort_filter`, the oracle),
    with rows that need the sort (top-p mass past the candidates) sorted, and rows without filters untouched.
    The sampler then draws the same tokens under the same seed."""
    from tokenmill.sample import sampler as sampler_mod

    g = torch.Generator().manual_seed(7)
    vocab, rows = (512, 6) if case == "narrow vocabulary" else (5000, 6)
    logits = torch.randn(rows, vocab, generator=g) * 4  # peaked: a top-p of 0.9 lies in the first ~100 tokens
    ks, ps = {"every row top-k": ([5, 40, 1, 300, 17, 2], [1.0, 0.9, 0.5, 0.95, 1.0, 0.2]),
              "top-p, candidates hold it": ([0] * 6, [0.9, 0.5, 0.99, 0.1, 0.95, 0.7]),
              "top-p, sort needed": ([0] * 6, [0.9, 0.999, 0.5, 0.9, 0.9, 0.9]),
              "mixed rows": ([0, 30, 0, 0, 8, 0], [0.9, 1.0, 1.0, 0.7, 0.8, 1.0]),
              "a top-k past the candidates": ([2000, 0, 1500, 0, 3, 0], [1.0, 0.9, 0.999, 0.5, 1.0, 1.0]),
              "narrow vocabulary": ([300, 0, 5, 0, 0, 0], [1.0, 0.95, 1.0, 0.9, 0.5, 0.8])}[case]
    if case == "top-p, sort needed":
        logits[1] = torch.randn(vocab, generator=g) * 0.1  # flat: 0.999 of its mass is nowhere near 1024 tokens
    top_k, top_p, min_p = torch.tensor(ks), torch.tensor(ps), torch.zeros(rows)
    use = (any(k > 0 for k in ks), any(p < 1 for p in ps), False)
    sorts = []
    real_sort = sampler_mod._sort_filter
    try:
        sampler_mod._sort_filter = lambda *a: (sorts.append(a[0].shape[0]), real_sort(*a))[1]
        fast = filter_logits(logits, top_k, top_p, min_p, *use, ks=ks, ps=ps)
    finally:
        sampler_mod._sort_filter = real_sort
    want = filter_logits(logits, top_k, top_p, min_p, *use)  # (no host settings: the whole sort)
    assert torch.equal(fast, want)
    assert sorts == {"top-p, sort needed": [rows], "narrow vocabulary": [rows]}.get(case, [])
    kept = torch.isfinite(fast).sum(-1).tolist()
    assert all(n < vocab for n, k, p in zip(kept, ks, ps) if k > 0 or p < 1) and max(kept) > 1
    assert all(n == vocab for n, k, p in zip(kept, ks, ps) if k == 0 and p == 1)
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, seed=i) for i, (k, p) in enumerate(zip(ks, ps))]
    sample_rows = [SampleRow(sp, [], [], torch.Generator().manual_seed(sp.seed)) for sp in params]
    again = [SampleRow(sp, [], [], torch.Generator().manual_seed(sp.seed)) for sp in params]
    tokens = Sampler(seed=1).sample(logits, sample_rows)
    real_filter = sampler_mod.filter_logits
    try:  # the same draw through the whole sort
        sampler_mod.filter_logits = lambda *a, ks=None, ps=None: real_filter(*a)
        assert torch.equal(Sampler(seed=1).sample(logits, again), tokens)
    finally:
        sampler_mod.filter_logits = real_filter


def test_the_cpu_noise_is_exponential_and_fine_near_zero():
    """The Gumbel-max noise on a CPU is -log(U): Exp(1) (mean and variance 1), never 0 or inf, and fine near 0,
    where the winners' noise lies in a flat row (U in float32 put it on a 6e-8 grid: ties in ~1 % of draws)."""
    from tokenmill.sample.sampler import _exponential

    e = _exponential(torch.empty(1 << 20), torch.Generator().manual_seed(5))
    assert torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean().item() - 1) < 0.01 and abs(e.var().item() - 1) < 0.02
    smallest = e.topk(1000, largest=False).values
    assert smallest.unique().numel() == 1000


def _chi2_against(counts, kept, expected):
    n = counts.sum()
    assert counts[kept].sum() == n  # never outside the kept set
    return float((((counts[kept] - n * expected) ** 2) / (n * expected)).sum())


def test_rows_sample_among_their_kept_tokens_with_the_same_law():
    """On a CPU, rows whose filters keep few tokens draw noise for those tokens only: the draws must follow the
    filtered softmax (chi-square), never leave the kept set; a seeded row draws over its own kept tokens, so it
    gives the same tokens alone and beside rows that keep more."""
    from tokenmill.sample import sampler as sampler_mod

    torch.manual_seed(0)
    logits = torch.randn(1, 400) * 2
    kept = logits[0].topk(6).indices
    expected = (logits[0, kept] / 0.7).softmax(-1)
    calls, own_calls = [], []
    real, real_own = sampler_mod._sample_among_support, sampler_mod._own_rows_sample
    sampler_mod._sample_among_support = lambda *a: (calls.append(tuple(a[0].shape)), real(*a))[1]
    sampler_mod._own_rows_sample = lambda *a: (own_calls.append(tuple(a[0].shape)), real_own(*a))[1]

    def seeded(seed):
        params = SamplingParams(temperature=0.7, top_k=6, seed=seed)
        return SampleRow(params, [], [], torch.Generator().manual_seed(seed))

    try:
        sampler, n, batch = Sampler(seed=11), 12000, 400
        counts = torch.zeros(400)
        for _ in range(n // batch):
            out = sampler(logits.expand(batch, -1).clone(), _rows(batch, temperature=0.7, top_k=6))
            counts += torch.bincount(torch.tensor(out.token_ids), minlength=400)
        own = torch.zeros(400)
        for first in range(0, 3000, 300):  # 3,000 seeds, a draw each
            rows = [seeded(s) for s in range(first, first + 300)]
            own += torch.bincount(sampler.sample(logits.expand(300, -1).clone(), rows), minlength=400)
        alone = [sampler.sample(logits.clone(), [seeded(5)])[0] for _ in range(2)]
        wide = _rows(1, temperature=0.7, top_k=40)
        mixed = sampler.sample(logits.expand(3, -1).clone(), wide + [seeded(5)] + wide)
    finally:
        sampler_mod._sample_among_support, sampler_mod._own_rows_sample = real, real_own
    assert calls == [(batch, 400)] * (n // batch) + [(2, 400)]  # unseeded rows: the compact path ran
    assert own_calls == [(300, 400)] * 10 + [(1, 400)] * 3
    assert _chi2_against(counts, kept, expected) < 20.5  # 5 degrees of freedom: p < 0.001 critical value
    assert _chi2_against(own, kept, expected) < 20.5
    assert alone[0] == alone[1] == mixed[1]
    assert set(mixed.tolist()) <= set(logits[0].topk(40).indices.tolist())


def test_top_p_keeps_at_least_one_token():
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    out = filter_logits(logits, torch.tensor([0]), torch.tensor([1e-6]), torch.tensor([0.0]), False, True, False)
    assert torch.isfinite(out).sum() == 1 and out[0, 0] == 10.0


def test_penalties():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    rp = SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0), [1], [2], None)
    pres = SampleRow(SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5), [0], [1, 1], None)
    from tokenmill.sample.sampler import apply_penalties

    a = logits.clone()
    apply_penalties(a, [rp])
    assert a.tolist() == [[1.0, 1.0, -2.0, 0.5]]
    b = logits.clone()
    apply_penalties(b, [pres])
    assert b.tolist() == [[1.0, 2.0 - 1.5 - 1.0, -1.0, 0.5]]


def _penalized_row_by_row(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The oracle: each row on its own, from the definitions (HF's repetition penalty, OpenAI's others)."""
    out = logits.clone().double()
    for i, r in enumerate(rows):
        sp = r.params
        for t in set(r.prompt_token_ids + r.output_token_ids) if sp.repetition_penalty != 1.0 else ():
            v = out[i, t]
            out[i, t] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
        for t in set(r.output_token_ids):
            out[i, t] -= sp.frequency_penalty * r.output_token_ids.count(t) + sp.presence_penalty
    return out


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 3)])
def test_penalties_for_a_mixed_batch_match_row_by_row(dtype, chunk, monkeypatch):
    """Rows with and without penalties, each kind alone and together, empty outputs, repeats and prompts of
    different lengths: the batched pass (in chunks of `chunk` penalized rows) equals each row done on its own."""
    from tokenmill.sample import sampler
    monkeypatch.setattr(sampler, "PENALTY_ROWS", chunk)
    g = torch.Generator().manual_seed(0)
    vocab = 50
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3),
              SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), SamplingParams(),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
              SamplingParams(frequency_penalty=2.0)]
    rows = [SampleRow(p, ids(3 + 7 * i), ids([0, 9, 0, 4, 30, 12][i]), None) for i, p in enumerate(params)]
    logits = torch.randn(len(rows), vocab, generator=g).to(dtype)
    from tokenmill.sample.sampler import apply_penalties

    got = logits.clone()
    apply_penalties(got, rows)
    want = _penalized_row_by_row(logits, rows)
    assert torch.allclose(got.double(), want, atol=1e-5 if dtype == torch.float32 else 4e-2)
    assert torch.equal(got[[0, 3]], logits[[0, 3]])  # rows without penalties are untouched
    assert not torch.equal(got[[1, 2, 4, 5]], logits[[1, 2, 4, 5]])


def test_min_tokens_masks_each_row_own_stop_ids_only():
    from tokenmill.sample.sampler import apply_min_tokens

    rows = [SampleRow(SamplingParams(min_tokens=3, stop_token_ids=[4, 7, 999]), [1], [2], None),  # 999: no logit
            SampleRow(SamplingParams(min_tokens=1, stop_token_ids=[5]), [1], [2], None),  # has its min already
            SampleRow(SamplingParams(min_tokens=2, stop_token_ids=[1]), [1], [], None)]
    logits = torch.zeros(3, 10)
    apply_min_tokens(logits, rows)
    assert torch.isinf(logits).nonzero().tolist() == [[0, 4], [0, 7], [2, 1]]


def test_logprobs_are_raw_log_softmax(llama_dir, hf_llama):
    llm = make_llm(llama_dir)
    prompt = random_prompts([10], seed=21)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, logprobs=4,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    ids = prompt + out.token_ids
    with torch.no_grad():
        ref = hf_llama(torch.tensor([ids])).logits[0].log_softmax(-1)
    for j, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert lps[tok].rank == 1  # greedy picks the top token
        top = row.topk(4)
        assert set(lps) == set(top.indices.tolist()) | {tok}
        for t, lp in lps.items():
            assert math.isclose(lp.logprob, float(row[t]), abs_tol=1e-4)
    assert math.isclose(out.cumulative_logprob, sum(out.logprobs[j][t].logprob for j, t in enumerate(out.token_ids)),
                        abs_tol=1e-5)


def test_stop_token_ids_min_tokens_and_max_tokens(llama_dir):
    llm = make_llm(llama_dir)
    prompt = random_prompts([8], seed=22)[0]
    free = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12,
                                                                    stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == free.token_ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # min_tokens bans the stop token until enough tokens exist
    c2 = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                                                   stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert len(c2.token_ids) >= first + 2 and stop_tok not in c2.token_ids[: first + 1]
    c3 = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert len(c3.token_ids) == 5 and c3.finish_reason == "length"


def test_eos_stops_unless_ignored(llama_dir):
    llm = make_llm(llama_dir)
    prompt = random_prompts([8], seed=23)[0]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    toks = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0].token_ids
    eos = toks[3]
    llm.llm_engine.input_processor.eos_token_ids = (eos,)  # pretend the model's EOS is the 4th greedy token
    stopped = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=10),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == toks[: toks.index(eos) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == toks and ignored.finish_reason == "length"


def test_seeded_n_completions_differ_and_reproduce(llama_dir):
    llm = make_llm(llama_dir)
    prompt = random_prompts([6], seed=24)[0]
    sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_top_logprobs_past_a_small_vocabulary_give_every_token():
    """logprobs=20 over a 12-token vocabulary: all 12, ranked, not a failed step (which would fail every request
    in the batch)."""
    from tokenmill.sample.sampler import token_logprob_rows, token_logprob_tensors

    lps = torch.randn(3, 12, generator=torch.Generator().manual_seed(0)).log_softmax(dim=-1)
    rows = token_logprob_rows(*token_logprob_tensors(lps, torch.tensor([0, 5, 11]), 20))
    for r, row in enumerate(rows):
        assert len(row) == 1 + 12
        assert [t for t, _, _ in row[1:]] == lps[r].argsort(descending=True).tolist()
        assert row[0][0] == [0, 5, 11][r] and row[0][1] == pytest.approx(lps[r, row[0][0]].item())


def test_logit_bias_steers_each_row_and_its_logprobs_stay_raw():
    """A row's bias is added to its own logits only (ids past the logits are left out); greedy then takes the
    biased token; logprobs are of the raw logits, as vLLM's default."""
    from tokenmill.sample.sampler import apply_logit_bias
    rows = [SampleRow(SamplingParams(logit_bias={3: 2.5, 9: -1.0, 999: 5.0}), [1], [], None),
            SampleRow(SamplingParams(), [1], [], None),
            SampleRow(SamplingParams(logit_bias={0: 1.0}), [1], [], None)]
    logits = torch.zeros(3, 10)
    apply_logit_bias(logits, rows)
    assert logits.nonzero().tolist() == [[0, 3], [0, 9], [2, 0]]
    assert logits[0, 3] == 2.5 and logits[0, 9] == -1.0 and logits[2, 0] == 1.0
    raw = torch.randn(2, 10, generator=torch.Generator().manual_seed(1))
    top = int(raw[0].argmax())
    steer = [SampleRow(SamplingParams(temperature=0, logprobs=1, logit_bias={top: -100.0, 4: 0.0}), [1], [], None),
             SampleRow(SamplingParams(temperature=0, logit_bias={7: 100.0}), [1], [], None)]
    assert not steer[0].params.argmax_only  # the engine's argmax-only fast paths must not take it
    out = Sampler()(raw, steer)
    assert out.token_ids[0] == int(raw[0].masked_fill(torch.arange(10) == top, -1e9).argmax())
    assert out.token_ids[1] == 7
    assert out.logprobs[0][0][1] == pytest.approx(raw[0].log_softmax(-1)[out.token_ids[0]].item())
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_logit_bias_through_the_engine_matches_with_async_scheduling(llama_dir):
    """The engine's paths that skip the sampler (the argmax-only step, bursts) must not skip a bias: a token
    biased up is what greedy decoding emits, and async scheduling gives the same tokens."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 9], seed=2)]
    plain = make_llm(llama_dir).generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                         use_tqdm=False)
    banned = plain[1].outputs[0].token_ids[0]  # what the second prompt's greedy decoding starts with
    sp = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={5: 100.0}),
          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={banned: -100.0})]
    outs = [[o.outputs[0].token_ids for o in make_llm(llama_dir, async_scheduling=a).generate(prompts, sp,
                                                                                              use_tqdm=False)]
            for a in (False, True)]
    assert outs[0] == outs[1]
    assert outs[0][0] == [5] * 8 and banned not in outs[0][1]


def test_a_huge_temperature_samples_uniformly_and_never_nan():
    """Temperatures past float32's range (the API has no upper bound, as vLLM) sample as MAX_TEMPERATURE: a
    -inf logit (min_tokens' mask) over an inf temperature would be NaN, and argmax of NaNs token 0."""
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(SamplingParams(temperature=1e39, min_tokens=3, stop_token_ids=[0]), [1], [], None)]
    probs = Sampler.probs(Sampler.adjusted_logits(logits, rows), rows)
    assert not probs.isnan().any() and probs[0, 0] == 0
    assert torch.allclose(probs[0, 1:], torch.full((9,), 1 / 9), atol=1e-3)


def test_logit_bias_comes_before_the_penalties_is_bounded_and_checked_against_the_vocabulary(llama_dir):
    """vLLM's order (bias, then penalties: a repetition penalty scales the biased logit); a bias past float
    range acts as +-1e4 instead of making NaNs; an id outside the vocabulary is refused, naming logit_bias."""
    logits = torch.tensor([[2.0, 3.0]])
    row = [SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 2.5}), [0], [], None)]
    assert Sampler()(logits, row).token_ids == [1]  # (2 + 2.5) / 2 = 2.25 < 3; the other order gives 0
    huge = [SampleRow(SamplingParams(temperature=0.5, logit_bias={1: 3e38}), [0], [], None)]
    probs = Sampler.probs(Sampler.adjusted_logits(logits, huge), huge)
    assert not probs.isnan().any() and probs[0, 1] == 1
    llm = make_llm(llama_dir)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llama_dir):
    """vLLM's truncate_prompt_tokens: the request runs on the prompt's last N tokens (a prompt longer than
    max_model_len fits that way), exactly as if only those had been sent."""
    llm = make_llm(llama_dir, max_model_len=64)
    long = random_prompts([90], seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                    truncate_prompt_tokens=20), use_tqdm=False)[0]
    tail = llm.generate([{"prompt_token_ids": long[-20:]}], sp, use_tqdm=False)[0]
    assert cut.prompt_token_ids == long[-20:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_allowed_token_ids_limit_each_row_only():
    """vLLM's allowed_token_ids: a row samples only among its ids (ids past the logits left out), the other rows
    are untouched, greedy takes the best allowed logit, and logprobs stay raw."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randn(3, 50, generator=g)
    rows = [SampleRow(SamplingParams(temperature=0, logprobs=0, allowed_token_ids=[4, 9, 31, 777]), [1], [], None),
            SampleRow(SamplingParams(temperature=0), [1], [], None),
            SampleRow(SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[2, 40]), [1], [], None)]
    assert not rows[0].params.argmax_only
    adjusted = Sampler.adjusted_logits(raw, rows)
    assert torch.equal(adjusted[1], raw[1])
    assert torch.isfinite(adjusted[0]).nonzero().view(-1).tolist() == [4, 9, 31]
    assert torch.isfinite(adjusted[2]).nonzero().view(-1).tolist() == [2, 40]
    for _ in range(5):
        out = Sampler()(raw, rows)
        assert out.token_ids[0] == max((4, 9, 31), key=lambda t: raw[0, t]) and out.token_ids[2] in (2, 40)
        assert out.token_ids[1] == int(raw[1].argmax())
        assert out.logprobs[0][0][1] == pytest.approx(raw[0].log_softmax(-1)[out.token_ids[0]].item())
    for bad in ([], [-1], "5"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_bad_words_ban_a_words_last_token_only_after_its_first_ones():
    from tokenmill.sample.sampler import bad_word_bans

    words = ((5,), (7, 8), (1, 2, 3))
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [9, 7]) == [5, 8]
    assert bad_word_bans(words, [1, 2]) == [5, 3]
    assert bad_word_bans(words, [2, 1]) == [5]
    raw = torch.randn(2, 12, generator=torch.Generator().manual_seed(0))
    sp = replace(SamplingParams(temperature=0), bad_words_token_ids=words)
    rows = [SampleRow(sp, [1], [4, 7], None), SampleRow(SamplingParams(temperature=0), [1], [7], None)]
    assert not sp.argmax_only and sp.reads_output
    adjusted = Sampler.adjusted_logits(raw, rows)
    assert torch.isinf(adjusted[0]).nonzero().view(-1).tolist() == [5, 8] and torch.equal(adjusted[1], raw[1])
    for bad in ([""], [3], "  "):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)


def test_bad_words_through_the_engine_with_async_scheduling_and_speculation():
    """The shipped model's greedy answer holds a word of one token ("I") and one of two (" Messenger"); banned,
    neither comes out, and the output keeps the plain answer up to the first one. The two-token word's second
    token is banned only after its first: async scheduling (where that first token may still be on the device)
    and n-gram speculation give the same tokens."""
    from tokenmill import LLM

    llm = LLM(dtype="float32")
    ref = llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    proc, ids = llm.llm_engine.input_processor, list(ref.token_ids)
    words = proc.bad_words_token_ids(["Messenger", "I"])
    two = [w for w in words if len(w) == 2 and any(ids[i:i + 2] == list(w) for i in range(len(ids)))]
    assert two and any(len(w) == 1 and w[0] in ids for w in words), (words, ids)
    sp = [SamplingParams(temperature=0, max_tokens=40, bad_words=["Messenger", "I"]),
          SamplingParams(temperature=0, max_tokens=40, bad_words=["Messenger"]),
          SamplingParams(temperature=0.8, seed=3, max_tokens=40, bad_words=["Messenger"], repetition_penalty=1.2)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = [[list(o.outputs[0].token_ids) for o in LLM(dtype="float32", **kw).generate(["ROMEO:"] * 3, sp,
                                                                                      use_tqdm=False)]
            for kw in (dict(), dict(async_scheduling=True), dict(speculative_config=ngram))]
    assert runs[0] == runs[1] == runs[2]
    messenger = proc.bad_words_token_ids(["Messenger"])
    for toks, banned in zip(runs[0], (words, messenger, messenger)):
        assert not any(toks[i:i + len(w)] == list(w) for w in banned for i in range(len(toks))), toks
    # only the pair is banned: the answer is the plain one through the pair's first token, then differs
    at = next(i for i in range(len(ids)) if ids[i:i + 2] == list(two[0]))
    assert runs[0][1][:at + 1] == ids[:at + 1] and runs[0][1][at + 1] != ids[at + 1]
    first = ref.text.index("I")
    assert llm.get_tokenizer().decode(runs[0][0]).startswith(ref.text[:first])
    with pytest.raises(ValueError, match="bad_words"):
        LLM(dtype="float32", skip_tokenizer_init=True).generate([{"prompt_token_ids": [5, 6]}], sp[0],
                                                                 use_tqdm=False)


def test_allowed_token_ids_through_the_engine_with_async_scheduling_and_speculation(llama_dir):
    """The argmax-only paths (the one-call step, bursts) must not skip the list; async scheduling and n-gram
    speculation (whose verification samples from the same limited logits) give the same tokens; an id outside
    the vocabulary is refused."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([6, 9, 14], seed=4)]
    allowed = [7, 11, 19, 23, 101]
    sp = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=1, max_tokens=10, ignore_eos=True, allowed_token_ids=allowed[:2])]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    runs = [[o.outputs[0].token_ids for o in make_llm(llama_dir, **kw).generate(prompts, sp, use_tqdm=False)]
            for kw in (dict(), dict(async_scheduling=True), dict(speculative_config=ngram))]
    assert runs[0] == runs[1] == runs[2]
    assert set(runs[0][0]) <= set(allowed) and set(runs[0][2]) <= set(allowed[:2])
    with pytest.raises(ValueError, match="allowed_token_ids"):
        make_llm(llama_dir).generate(prompts[:1], SamplingParams(allowed_token_ids=[10**6]), use_tqdm=False)


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token():
    raw = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(SamplingParams(temperature=1.0, top_p=1e-300, seed=s), [1], [], None) for s in (1, 2)]
    for _ in range(3):
        assert Sampler()(raw, rows).token_ids == raw.argmax(-1).tolist()


def test_constraints_that_leave_no_token_end_the_request_with_a_stop_token(llama_dir):
    """allowed_token_ids that bad words (or min_tokens) ban entirely: the row gets its stop tokens back instead of
    sampling from all -inf (token 0, or NaN); without a stop token (ignore_eos) it is left alone. Through the
    engine a grammar that the allowed list contradicts ends the request at once, never with a token outside
    the list."""
    raw = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    both = replace(SamplingParams(temperature=0, allowed_token_ids=[7], stop_token_ids=[9]),
                   bad_words_token_ids=((7,),))
    ok = SamplingParams(temperature=0.7, seed=1, allowed_token_ids=[7, 8], stop_token_ids=[9])
    no_stop = replace(SamplingParams(temperature=0, allowed_token_ids=[7], ignore_eos=True),
                      bad_words_token_ids=((7,),))
    adjusted = Sampler.adjusted_logits(raw, [SampleRow(p, [1], [], None) for p in (both, ok, no_stop)])
    assert torch.isfinite(adjusted[0]).nonzero().view(-1).tolist() == [9]
    assert torch.isfinite(adjusted[1]).nonzero().view(-1).tolist() == [7, 8]
    assert not torch.isfinite(adjusted[2]).any()
    llm = make_llm(llama_dir)
    eos = llm.llm_engine.input_processor.eos_token_ids[0]
    sp = SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[5, 6], structured_outputs={"regex": "abc"})
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"


def test_extreme_repetition_penalties_keep_the_row_finite():
    raw = torch.randn(1, 30, generator=torch.Generator().manual_seed(4))
    for rp in (1e-40, 1e40):
        row = SampleRow(SamplingParams(temperature=0.8, seed=1, repetition_penalty=rp), [1, 2], [3], None)
        adjusted = Sampler.adjusted_logits(raw, [row])
        assert torch.isfinite(adjusted).all()
        assert Sampler.probs(adjusted, [row]).isfinite().all()
