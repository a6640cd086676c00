"""Speculative decoding: n-gram drafts, lossless verification (greedy and sampled), rollback of rejected
drafts, multi-token steps downstream (stop strings, max_tokens, logprobs), adaptive depth, bad config."""
import numpy as np
import pytest
import torch

from tests.conftest import make_llm, random_prompts
from tokenmill import SamplingParams
from tokenmill.sample.sampler import SampleRow, Sampler
from tokenmill.spec_decode.adaptive import DraftPolicy, RowCost
from tokenmill.spec_decode.bandit import DepthBandit
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer, ngram_propose
from tokenmill.spec_decode.verify import DraftCheck, verify

# fixed depth where a test needs drafts to happen; the adaptive policy is tested on its own
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
         "adaptive": False}


# -- the proposer -------------------------------------------------------------------------------------------
def test_ngram_takes_the_longest_suffix_match_and_its_latest_occurrence():
    t = np.array([7, 1, 2, 3, 9, 9, 2, 3, 4, 4, 1, 2, 3])
    assert ngram_propose(t, 2, 1, 3) == [9, 9]  # "1 2 3" matched at 1 (n=3 beats the later "2 3")
    assert ngram_propose(t, 2, 1, 2) == [4, 4]  # only up to 2 tokens: the latest "2 3" is at 6
    assert ngram_propose(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    assert ngram_propose(np.array([5, 5, 5]), 4, 2, 2) == [5]  # the tail runs out
    assert ngram_propose(np.array([8] * 9), 3, 2, 2) == [8, 8, 8]  # not the latest match: one token follows it


def _ngram_brute_force(t: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, spelled out: the longest n whose suffix occurs earlier (followed by a token); its latest
    occurrence that k tokens follow, else its earliest."""
    L = len(t)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        hits = [s for s in range(L - n) if t[s:s + n] == t[L - n:]]
        if hits:
            whole = [s for s in hits if s + n + k <= L]
            start = (whole[-1] if whole else hits[0]) + n
            return t[start:start + k]
    return []


def test_ngram_matches_the_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(3000):
        t = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(1, 40))).tolist()
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 7))
        assert ngram_propose(np.array(t, dtype=np.int64), k, min_n, max_n) == _ngram_brute_force(t, k, min_n, max_n)


def test_ngram_proposer_follows_growing_sequences():
    p = NgramProposer(1, 3)
    assert p.propose("a", [1, 2, 3, 1], [2], 2) == [3, 1]
    assert p.propose("a", [1, 2, 3, 1], [2, 3], 3) == [1, 2, 3]
    p.release(["a"])
    assert p.propose("a", [4, 5], [], 3) == []


# -- verification on its own ----------------------------------------------------------------------------------
def _row(**kw):
    return SampleRow(SamplingParams(**kw), [1, 2], [], None)


def test_greedy_verification_accepts_the_matching_prefix_then_corrects():
    logits = torch.full((4, 10), -5.0)
    for i, t in enumerate([3, 4, 7, 8]):  # the target's argmax at each of the k + 1 rows
        logits[i, t] = 5.0
    out, _ = verify(Sampler(0), logits, [DraftCheck(_row(temperature=0), [3, 4, 5])])
    assert out == [[3, 4, 7]]  # two accepted, then the target's token
    out, _ = verify(Sampler(0), logits, [DraftCheck(_row(temperature=0), [3, 4, 7])])
    assert out == [[3, 4, 7, 8]]  # all accepted, plus the bonus token


def _chi_square_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    from scipy.stats import chisquare

    probs = np.asarray(probs, dtype=np.float64) / np.sum(probs, dtype=np.float64)  # float32 sums miss 1
    keep = probs * counts.sum() >= 5
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    return chisquare(obs[exp > 0], exp[exp > 0]).pvalue > 1e-3


@pytest.mark.parametrize("proposer", ["one-hot", "full q"])
def test_rejection_sampling_follows_the_target_distribution(proposer):
    """Drafts that disagree often, two per step, each row with its own target p: the first emitted token must
    follow row 0's p and, when the first draft was accepted, the second row 1's (chi-square). A verifier that
    accepted with the wrong ratio, drew the residual wrongly or read the wrong row after an acceptance would
    bend one of them. One-hot: a deterministic proposer (the draft model drafts greedily, n-gram copies)."""
    V = 8
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(3, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    p = torch.softmax(rows, -1).numpy()
    first, second = np.zeros(V), np.zeros(V)
    sampler, gen = Sampler(0), torch.Generator().manual_seed(1)
    for _ in range(6000):
        if proposer == "full q":
            drafts, dq = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)], q
        else:
            drafts, dq = [int(np.argmax(p[0])), int(np.argmax(p[1]))], None
        check = DraftCheck(SampleRow(SamplingParams(temperature=1.0, seed=1), [1], [], gen), drafts, dq)
        out = verify(sampler, rows, [check])[0][0]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert second.sum() > 1000  # enough accepted first drafts to judge the second position
    assert _chi_square_ok(first, p[0]) and _chi_square_ok(second, p[1])
    assert not _chi_square_ok(second, p[0])  # the test can tell the rows apart


# -- the engine: greedy identity ----------------------------------------------------------------------------
def _repetitive(n, seed=0):
    """Prompts that repeat themselves, so prompt lookup has something to find."""
    out = []
    for i, base in enumerate(random_prompts([12] * n, seed=seed)):
        out.append({"prompt_token_ids": (base * 6)[: 40 + 7 * i]})
    return out


def _tokens(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def greedy_reference(llama_dir):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return _tokens(make_llm(llama_dir), _repetitive(6), sp)


def _check(llm):
    llm.llm_engine.check_invariants()  # every block back: rejected drafts leaked nothing
    return llm.llm_engine.get_stats()


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_is_token_identical_with_ngram_drafts(llama_dir, greedy_reference, adaptive):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = make_llm(llama_dir, speculative_config={**NGRAM, "adaptive": adaptive})
    assert _tokens(llm, _repetitive(6), sp) == greedy_reference
    st = _check(llm)
    assert st.spec_num_draft_tokens > 0 and st.spec_num_accepted_tokens > 0
    assert sum(st.spec_accepted_per_pos) == st.spec_num_accepted_tokens
    assert st.spec_mean_acceptance_length > 1


def test_draft_slots_never_enter_the_prefix_cache(llama_dir, monkeypatch):
    """A block is offered to the prefix cache only once every slot in it holds a real token's KV: a block whose
    last slots hold drafts (rejected, or not verified yet) is offered at a later step, if ever."""
    from tokenmill.kv.manager import KVCacheManager

    held_back = []  # allocations whose drafts filled a block that a real token has not
    register, allocate = KVCacheManager._register, KVCacheManager.allocate_slots

    def spy_register(self, req, blocks, full):
        assert full * self.block_size <= req.num_tokens + req.num_pending, (req.request_id, full, req.num_tokens)
        return register(self, req, blocks, full)

    def spy_allocate(self, req, num_new_tokens, *args, num_draft_tokens=0, **kw):
        total = req.num_computed_tokens + num_new_tokens
        if total // self.block_size > (total - num_draft_tokens) // self.block_size:
            held_back.append(req.request_id)
        return allocate(self, req, num_new_tokens, *args, num_draft_tokens=num_draft_tokens, **kw)

    monkeypatch.setattr(KVCacheManager, "_register", spy_register)
    monkeypatch.setattr(KVCacheManager, "allocate_slots", spy_allocate)
    llm = make_llm(llama_dir, speculative_config=NGRAM)
    _tokens(llm, _repetitive(6), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert held_back  # drafts did reach past a block's end
    st = _check(llm)
    assert st.spec_num_draft_tokens > st.spec_num_accepted_tokens  # and some were rejected


def test_greedy_identical_with_chunked_prefill_prefix_hits_and_preemption(llama_dir):
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    shared = random_prompts([40], seed=5)[0]
    prompts = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in _repetitive(5, seed=2)]
    kw = dict(num_kv_blocks=24, max_num_batched_tokens=24, max_model_len=256)
    plain = _tokens(make_llm(llama_dir, **kw), prompts, sp)
    llm = make_llm(llama_dir, **kw, speculative_config=NGRAM)
    assert _tokens(llm, prompts, sp) == plain
    st = _check(llm)
    assert st.num_preemptions > 0 and st.prefix_cache_hits > 0 and st.spec_num_accepted_tokens > 0


def test_drafts_that_do_not_fit_are_dropped_rather_than_preempt(llama_dir):
    """A decode whose drafts' slots do not fit but whose own token does runs without its drafts: speculation
    never preempts another request. (It preempted on every such step, each a whole context recomputed: in a
    review's run on the shipped model, 44 preemptions with n-gram drafts against 29 without.)"""
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = _repetitive(6, seed=3)
    kw = dict(num_kv_blocks=10, max_model_len=128)
    plain_llm = make_llm(llama_dir, **kw)
    plain = _tokens(plain_llm, prompts, sp)
    llm = make_llm(llama_dir, **kw, speculative_config=NGRAM)
    kv = llm.llm_engine.core.scheduler.kv
    calls, real = [], kv.allocate_slots

    def allocate_slots(req, n, *a, num_draft_tokens=0, **k):
        ok = real(req, n, *a, num_draft_tokens=num_draft_tokens, **k)
        calls.append((req.request_id, num_draft_tokens > req.num_pending, ok))
        return ok
    kv.allocate_slots = allocate_slots
    assert _tokens(llm, prompts, sp) == plain
    # every allocation that failed with drafts is retried at once without them (the drafts dropped), never
    # answered by a preemption; the pool is tight enough that requests' own tokens do preempt
    failed = [i for i, (_, drafted, ok) in enumerate(calls) if drafted and not ok]
    assert failed and all(i + 1 < len(calls) and calls[i + 1][0] == calls[i][0] and not calls[i + 1][1]
                          for i in failed)
    assert _check(llm).num_preemptions > 0 and plain_llm.llm_engine.get_stats().num_preemptions > 0


def _proposer(name: str, llama_dir: str) -> dict:
    """n-gram lookup, or the target as its own draft model (every draft accepted), at a fixed depth."""
    return NGRAM if name == "ngram" else _draft_cfg(llama_dir, adaptive=False)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_requests_arriving_mid_run(llama_dir, greedy_reference, proposer):
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = make_llm(llama_dir, speculative_config=_proposer(proposer, llama_dir))
    eng, prompts, done = llm.llm_engine, _repetitive(6), {}
    eng.add_request("0", prompts[0], sp)
    for step in range(200):
        if step % 5 == 0 and step // 5 < len(prompts) - 1:
            i = step // 5 + 1
            eng.add_request(str(i), prompts[i], sp)
        for o in eng.step():
            if o.finished:
                done[int(o.request_id)] = o.outputs[0].token_ids
        if len(done) == len(prompts):
            break
    assert [done[i] for i in range(len(prompts))] == greedy_reference
    _check(llm)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_stop_strings_and_max_tokens_inside_an_accepted_run(llama_dir, stop_cuts, proposer):
    """A stop string or max_tokens that lands inside a run of accepted drafts must cut the output exactly
    where plain decoding stops. Stop strings are tried at many offsets; at least one must have cut a
    multi-token step short (spied on the detokenizer)."""
    prompt = _repetitive(1, seed=4)[0]
    plain_llm, spec_llm = make_llm(llama_dir), make_llm(llama_dir, speculative_config=_proposer(proposer, llama_dir))
    base = plain_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    params = [SamplingParams(temperature=0, max_tokens=60, stop=[base.text[i:i + 3]])
              for i in range(4, len(base.text) - 3, 5) if base.text[i:i + 3].strip()]
    params += [SamplingParams(temperature=0, max_tokens=m, logprobs=2) for m in (7, 13, 22)]
    for sp in params:
        a = plain_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        b = spec_llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
        if sp.logprobs:
            assert [sorted(x) for x in b.logprobs] == [sorted(x) for x in a.logprobs]
            assert [x[t].logprob for x, t in zip(b.logprobs, b.token_ids)] == pytest.approx(
                [x[t].logprob for x, t in zip(a.logprobs, a.token_ids)], abs=1e-4)
    assert any(c > 0 for c in stop_cuts), stop_cuts  # some stop string landed inside an accepted run
    _check(spec_llm)


def test_a_draft_model_never_drafts_past_max_model_len(llama_dir):
    """Requests that end by max_model_len with every draft accepted (the target drafts for itself): the draft's
    steps after a verification run from the last accepted position on, so a bound taken before the step let
    them index past the rotary table (an IndexError that failed the whole step)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 11, 17], seed=3)]
    sp = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    kw = dict(max_model_len=48, enforce_eager=True)
    plain = _tokens(make_llm(llama_dir, **kw), prompts, sp)
    llm = make_llm(llama_dir, **kw, speculative_config=_draft_cfg(llama_dir, adaptive=False))
    kv, most = llm.llm_engine.core.kv, [0]
    allocate = kv.allocate_slots

    def spy(req, n, *a, **k):  # the most slots any request reserves (look-ahead included)
        most[0] = max(most[0], req.num_computed_tokens + n)
        return allocate(req, n, *a, **k)
    kv.allocate_slots = spy
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert most[0] <= 48  # no look-ahead slot past max_model_len (a block table wider than its sequences)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(o.outputs[0].finish_reason == "length" and len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 48
               for o in outs)
    _check(llm)


# -- the engine: sampling ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("draw_ahead", [False, True])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(llama_dir, monkeypatch, draw_ahead):
    """With a deterministic proposer each emitted token costs one draw, in order (spec_decode/verify.py),
    so a seed reproduces plain decoding exactly, penalties and filters included. `draw_ahead`: the GPU's way,
    every row drawn before one read back, the seeded generators then rewound to the last emitted draw."""
    if draw_ahead:
        from tokenmill.spec_decode import verify
        monkeypatch.setattr(verify, "DRAW_AHEAD_DEVICES", {"cpu", "cuda"})
    prompts = _repetitive(4, seed=7)
    sps = [SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
           SamplingParams(temperature=1.2, top_k=5, min_p=0.05, repetition_penalty=1.1, seed=3, max_tokens=40,
                          ignore_eos=True),
           SamplingParams(temperature=0.5, presence_penalty=0.3, frequency_penalty=0.2, seed=5, max_tokens=40,
                          ignore_eos=True, min_tokens=10)]
    plain = make_llm(llama_dir)
    spec = make_llm(llama_dir, speculative_config={**NGRAM, "num_speculative_tokens": 3})
    for sp in sps:
        assert _tokens(spec, prompts, sp) == _tokens(plain, prompts, sp)
    assert _check(spec).spec_num_accepted_tokens > 0


# -- adaptive depth -------------------------------------------------------------------------------------------
class _AlwaysWrong(NgramProposer):
    def __init__(self):
        super().__init__(1, 1)

    def propose(self, request_id, prompt, output, k):
        return [1] * k  # token 1 is never the model's choice here


def test_adaptive_depth_falls_to_zero_for_a_draft_that_is_always_wrong(llama_dir):
    sp = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    llm = make_llm(llama_dir, max_model_len=256, speculative_config={**NGRAM, "adaptive": True})
    eng = llm.llm_engine
    eng.core.runner.proposer = _AlwaysWrong()
    eng.add_request("a", {"prompt_token_ids": random_prompts([20], seed=1)[0]}, sp)
    for _ in range(40):
        eng.step()
    early = eng.get_stats().spec_num_draft_tokens
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    late = eng.get_stats().spec_num_draft_tokens - early
    assert eng.get_stats().spec_num_accepted_tokens == 0 and early > 0
    assert late <= steps // 16 + 1  # only the periodic one-draft probes
    _check(llm)


def test_probes_of_idle_requests_fall_on_the_same_steps():
    """Requests whose drafts never land, admitted at different steps: each still probes with one draft every
    16 plans or so, but all on the same plans, since each step that proposes (and the next, which verifies) is
    a single step where decoding would run bursts. On each request's own count, four requests broke bursts
    four times as often (n-gram on free text at 4 requests: 0.93x of no speculation)."""
    policy = DraftPolicy(k_max=4, per_request=True)
    rids = ["a", "b", "c", "d"]
    for rid in rids:
        for _ in range(20):
            policy.record(rid, 1, 0)  # never accepted: no request's useful depth is above 0
    probes = {}
    for step in range(96):
        for rid in policy.plan(rids[: 1 + min(3, step // 5)]):  # joining at steps 0, 5, 10 and 15
            probes.setdefault(step, []).append(rid)
    assert len(probes) <= 96 // 16  # one probing step per 16 plans, not one per request
    assert all(sum(rid in p for p in probes.values()) >= 4 for rid in rids)  # and every request still probes
    assert max(len(p) for p in probes.values()) == 4


def _simulate(step_seconds, accept: float, steps: int = 300, batch: int = 4) -> list[int]:
    """Drive a DraftPolicy through a synthetic world: each verified draft survives with probability
    `accept`, a step at depth k takes step_seconds(k). Returns the depths planned."""
    rng = np.random.default_rng(0)
    policy, depths = DraftPolicy(k_max=4), []
    rids = [f"r{i}" for i in range(batch)]
    plan = {rid: 0 for rid in rids}
    for _ in range(steps):
        verifying, plan = plan, policy.plan(rids)  # this step verifies last step's plan ({}: no drafts)
        depth = max(verifying.values(), default=0)
        depths.append(max(plan.values(), default=0))
        emitted = 0
        for rid in rids:
            k = verifying.get(rid, 0)
            acc = 0
            while acc < k and rng.random() < accept:
                acc += 1
            if k:
                policy.record(rid, k, acc)
            emitted += acc + 1
        policy.observe_step(emitted, step_seconds(depth), 0, 0.0)
    return depths


def test_draft_policy_learns_when_drafts_pay():
    memory_bound = _simulate(lambda k: 0.010 + 0.0002 * k, accept=0.8)  # drafts nearly free
    compute_bound = _simulate(lambda k: 0.010 * (1 + k), accept=0.8)  # every draft token costs a full one
    hopeless = _simulate(lambda k: 0.010 + 0.0002 * k, accept=0.0)
    late = slice(150, None)
    assert np.mean(memory_bound[late]) > 3.0  # mostly the full depth, 4
    assert np.mean(np.array(compute_bound[late]) == 0) > 0.8  # mostly off, apart from exploration
    policy = DraftPolicy(k_max=4)
    for _ in range(20):
        policy.record("bad", 4, 0)
    assert policy._useful_depth("bad", 4) == 0  # a^1 below min_gain: no drafts, whatever the depth
    assert sum(hopeless[late]) <= len(hopeless[late]) // 4  # only probes and exploration
    # one draft does not pay for a verification's fixed cost (1.6 tokens for 1.67x the time), four do (2.3
    # tokens for 1.73x): the policy must find the deep optimum past the shallow loss (a climb from 0 stopped)
    fixed_cost = _simulate(lambda k: 0.010 * (1 + 0.65 * (k > 0) + 0.02 * k), accept=0.6)
    # 2, 3 and 4 run at 1.16, 1.27 and 1.33x of no drafts (1 at 0.96x), with single steps this noisy
    assert np.mean(np.array(fixed_cost[late]) >= 2) > 0.8


def test_useful_depth_follows_runs_that_go_on_once_started():
    """Copying: a run of drafts either fails at once or goes on (accepted 0.95 past the first draft), so a
    request accepted ~30 % of the time is still worth 8 drafts, where a geometric 0.3^k stops at one or two; with
    runs that break at each position like the first, the depth stays short."""
    rng = np.random.default_rng(3)
    copying, geometric = DraftPolicy(k_max=8), DraftPolicy(k_max=8)
    for _ in range(200):
        started = rng.random() < 0.3
        copying.record("other", 8, sum(np.cumprod(rng.random(7) < 0.95)) + 1 if started else 0)
        geometric.record("other", 8, int(sum(np.cumprod(rng.random(8) < 0.3))))
    for policy in (copying, geometric):
        for accepted in (0, 0, 1, 0, 0, 1, 0):
            policy.record("r", 1, accepted)
        assert 0.2 < policy.acceptance("r") < 0.45
    assert copying._useful_depth("r", 8) == 8
    assert geometric._useful_depth("r", 8) <= 2


def test_ngram_drafting_is_charged_what_admitting_costs_without_drafts():
    """A draft model prefills every admitted prompt too, so until drafting has measured its own admissions
    they are priced at depth 0's cost scaled up; n-gram lookup adds nothing to an admission, so the prior is
    depth 0's cost itself (charged double, 7K-token documents per 256 new tokens priced n-gram drafting out)."""
    policies = {model: DraftPolicy(k_max=4, model_proposer=model) for model in (False, True)}
    for policy in policies.values():
        for _ in range(20):  # depth 0: decode steps of 10 ms, and a 1,000-token prompt admitted every 10th step
            policy.bandit.observe(1, 0, 1, 0.010)
        policy._admission[False] = [1000.0, 0.5]  # 0.5 ms per prompt token at depth 0
        policy._prefill_per_token = [1000.0, 10.0]
    plain = policies[False]._admission_surcharge(1, 0)
    assert plain == pytest.approx(0.05)
    assert policies[False]._admission_surcharge(1, 4) == pytest.approx(plain)
    assert policies[True]._admission_surcharge(1, 4) > 1.5 * plain


def _simulate_regimes(row_cost: float, steps: int = 3000, batch: int = 1) -> tuple[list[int], list[int]]:
    """n-gram-like drafts with per_request depths: each request alternates between copying (every 60 steps of
    its own: a run starts with chance 0.6 and goes on at 0.95) and free text (drafts rejected); a step takes
    10 ms plus row_cost per draft row. Returns the drafts planned per step in the second half of each phase, in
    copying and in free text."""
    rng = np.random.default_rng(5)
    policy = DraftPolicy(k_max=8, per_request=True)
    rids = [f"r{i}" for i in range(batch)]
    plan, copying_k, free_k = {}, [], []
    for step in range(steps):
        verifying, plan = plan, policy.plan(rids)
        copying = (step // 60) % 2 == 0
        if step % 60 >= 30:  # the second half of each phase: the request has seen which regime it is in
            (copying_k if copying else free_k).append(sum(plan.values()))
        emitted = rows = 0
        for rid in rids:
            k, acc = verifying.get(rid, 0), 0
            if k and copying and rng.random() < 0.6:
                acc = 1
                while acc < k and rng.random() < 0.95:
                    acc += 1
            if k:
                policy.record(rid, k, acc)
            emitted += acc + 1
            rows += k
        policy.observe_step(emitted, 0.010 + row_cost * rows + rng.normal(0, 0.0005), 0, 0.0, 0.0, rows)
    return copying_k, free_k


def test_per_request_depth_follows_each_request_between_copying_and_free_text():
    """Draft rows cost 0.3 ms beside a 10 ms step (one request over a long context): requests draft deep while
    they copy and stop in free text, apart from probes, learning the row cost from the steps; where a draft
    row costs as much as the step itself (compute-bound), they barely draft at all. No step is pushed past the
    rows its fast path takes."""
    copying, free = _simulate_regimes(0.0003)
    assert np.mean(copying[150:]) > 5 and np.mean(free[150:]) < 0.5
    copying, free = _simulate_regimes(0.010)
    assert np.mean(copying[150:]) < 2 and np.mean(free[150:]) < 0.2
    # a step that keeps its fast path up to 4 rows (the CPU's one-call step): one request drafts at most 3
    policy = DraftPolicy(k_max=8, per_request=True)
    policy.max_rows = 4
    for _ in range(40):
        k = policy.plan(["r"]).get("r", 0)
        assert k <= 3
        policy.record("r", max(k, 1), max(k, 1))
        policy.observe_step(1 + k, 0.010 + 0.0003 * k, 0, 0.0, 0.0, k)
    assert policy.row_cost[1].n > 20 and policy.plan(["r"]) == {"r": 3}
    cost = RowCost(1)
    for rows in (0, 8, 0, 4, 8, 0) * 5:
        cost.observe(rows, 0.010 + 0.0003 * rows)
    c0, c1 = cost.line()
    assert c0 == pytest.approx(0.010, rel=0.05) and c1 == pytest.approx(0.0003, rel=0.15)  # the prior pulls a little


def test_draft_policy_skips_depths_that_acceptance_says_cannot_pay():
    """One draft costs a full step and drafts are accepted 40 % of the time: four drafts could emit at most
    (1 + .4 + .4^2 + .4^3 + .4^4) / 1.4 = 1.19x the tokens of one at no less cost, which still loses to no
    drafts, so depth 4 is never tried; where drafts are cheap and accepted, it still is."""
    compute_bound = _simulate(lambda k: 0.010 * (1 + k), accept=0.4)
    assert 4 not in compute_bound and 1 in compute_bound
    assert 4 in _simulate(lambda k: 0.010 + 0.0002 * k, accept=0.8)


def test_bandit_settles_hopeless_depths_in_one_try_and_backs_off_looking_at_them():
    """Where a verification costs 4x a plain step (it left the fast decode path), each look at depth > 0 costs
    three steps: one try settles such a depth, and the looks back at it grow apart (128, 256, ... steps);
    when drafts start to pay, a look notices and the bandit moves."""
    bandit = DepthBandit(k_max=4)
    rate = {0: 1000.0, 1: 250.0, 2: 240.0, 3: 230.0, 4: 220.0}  # tokens / s at each depth
    played = []
    for _ in range(2000):
        k = bandit.choose(16)
        played.append(k)
        bandit.observe(16, k, int(rate[k] / 100), 0.01)
    nonzero = sum(1 for k in played if k)
    assert 3 <= nonzero <= 8  # the first tries of 1 and 4, then a look at 1 at steps ~128, 384, 896, 1920
    assert all(k == 0 for k in played[200:380])
    rate[1] = 3000.0  # drafts now pay three times over
    for _ in range(3000):
        k = bandit.choose(16)
        bandit.observe(16, k, int(rate[k] / 100), 0.01)
    assert bandit.choose(16) >= 1


def test_bandit_backs_off_looks_that_keep_losing_and_comes_back_when_one_wins():
    """A depth at 0.6x of no drafts is no hopeless one (it takes its three tries), but each look that still
    loses waits twice as long as the last: looks are what a server held at no drafts pays for drafting. When
    drafts start to pay, the next look notices and the bandit moves."""
    bandit = DepthBandit(k_max=4)
    rate = {0: 1000.0, 1: 600.0, 2: 580.0, 3: 560.0, 4: 550.0}
    looks = {1: [], 4: []}  # from no drafts, depths 1 and k_max are looked at, each on its own schedule
    for step in range(6000):
        k = bandit.choose(16)
        if k and step > 50:  # after the first tries
            looks[k].append(step)
        bandit.observe(16, k, int(rate[k] / 100), 0.01)
    for steps in looks.values():
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        cap = bandit.max_explore_every
        assert 3 <= len(gaps) <= 6 and all(b >= min(1.8 * a, cap) for a, b in zip(gaps, gaps[1:])), gaps
    rate[1] = 3000.0
    for _ in range(4200):  # the longest wait, then a few steps at 1 (first tries)
        k = bandit.choose(16)
        bandit.observe(16, k, int(rate[k] / 100), 0.01)
    assert bandit.best(16) >= 1


def test_bandit_keeps_looking_at_no_drafts_while_drafting():
    """Drafting wins at first; then the machine's speed moves and no drafts runs twice as fast as drafting.
    Depth 0 is the fallback, and its estimate is what went stale: looks at it keep their base interval while
    it loses by a little (they do not back off as looks away from 0 do), so the bandit returns within a few
    hundred steps."""
    bandit = DepthBandit(k_max=4)
    rate = {0: 1000.0, 1: 1500.0, 2: 1450.0, 3: 1400.0, 4: 1350.0}
    for _ in range(3000):
        k = bandit.choose(4)
        bandit.observe(4, k, rate[k] / 100, 0.01)
    assert bandit.best(4) >= 1
    rate[0] = 3000.0
    for step in range(400):
        k = bandit.choose(4)
        bandit.observe(4, k, rate[k] / 100, 0.01)
        if bandit.best(4) == 0:
            break
    assert bandit.best(4) == 0, "still drafting 400 steps after no drafts became twice as fast"


def test_bandit_leaves_no_drafts_only_when_a_second_look_agrees():
    """One look that lands on a lucky step (or against a depth-0 rate from a slow stretch) does not make the
    bandit leave no drafts: it looks again at once, and leaves only if that look wins too."""
    def world(lucky_looks: int) -> list[int]:
        bandit, rate, wins = DepthBandit(k_max=4), {0: 1000.0, 1: 600.0, 2: 580.0, 3: 560.0, 4: 550.0}, 0
        bests = []
        for _ in range(3000):
            k = bandit.choose(4)
            r = rate[k]
            if k == 1 and bandit.exploring and len(bests) > 200 and wins < lucky_looks:
                r, wins = 3000.0, wins + 1
            bandit.observe(4, k, r / 100, 0.01)
            bests.append(bandit.best(4))
        return bests

    assert max(world(lucky_looks=1)) == 0  # one lucky look: still no drafts
    assert 1 in world(lucky_looks=2)  # two in a row: it leaves

    def engine_world(lucky_looks: int) -> list[int]:
        """As an engine runs it: a step's result is credited after the next step's depth is chosen."""
        bandit, rate, wins = DepthBandit(k_max=4), {0: 1000.0, 1: 600.0, 2: 580.0, 3: 560.0, 4: 550.0}, 0
        bests, last = [], None
        for _ in range(3000):
            k = bandit.choose(4)
            if last is not None:
                bandit.observe(4, *last)
            r = rate[k]
            if k == 1 and bandit.exploring and len(bests) > 200 and wins < lucky_looks:
                r, wins = 3000.0, wins + 1
            last = (k, r / 100, 0.01)
            bests.append(bandit.best(4))
        return bests

    assert max(engine_world(lucky_looks=1)) == 0  # the second look waited for, not skipped


def _noisy_world(gain: float, z: float, seed: int, steps: int = 3000) -> tuple[float, int]:
    """Depths 0 and 1; a step's seconds vary by 15 % (normal); depth 1 is `gain` times as fast. Returns the
    share of late steps whose best depth is 1 and how many times the best depth changed. Looks come at the base
    interval (no backing off from losing ones), so that the flaps measure the test alone."""
    rng = np.random.default_rng(seed)
    bandit, bests = DepthBandit(k_max=1, z=z, leave_margin=1.05, max_explore_every=32), []
    for _ in range(steps):
        k = bandit.choose(4)
        bests.append(bandit.best(4))
        bandit.observe(4, k, 8, 0.002 / (gain if k else 1.0) * max(0.3, 1 + rng.normal(0, 0.15)))
    return float(np.mean(bests[500:])), sum(a != b for a, b in zip(bests, bests[1:]))


def test_bandit_returns_to_no_drafts_when_it_clearly_beats_the_depth_played():
    """Depth 2 is played; depth 1's rate tops the table but from three noisy steps, so it never clears the test
    against 2; depth 0 beats 2 steadily. The bandit must go back to 0 rather than wait on 1."""
    b = DepthBandit(k_max=4)
    rng = np.random.default_rng(0)
    for k, rate, n in ((0, 2400, 20), (2, 1700, 20), (3, 1000, 3), (4, 1000, 3)):
        for _ in range(n):
            b.observe(1, k, 1.0, (1 + 0.01 * rng.standard_normal()) / rate)
    for rate in (6000, 1200, 6000):
        b.observe(1, 1, 1.0, 1 / rate)
    assert b.rate(1, 1) > b.rate(1, 0) > b.rate(1, 2)
    b._best[1] = 2
    b.choose(1)
    assert b.best(1) == 0


def test_a_bursting_engines_depth_zero_steps_count_at_a_bursts_cost():
    """With bursts, a depth-0 step that proposes drafts (a look, or a first try's neighbour) is a single step only
    because of them; it is charged a burst's step, so depth 0 is rated at what it gives here."""
    policy = DraftPolicy(k_max=4)
    policy._verifying = (1, 0, False)
    policy.observe_step(10, 0.002, 0, 0.0, steps=10)  # a burst: 10 tokens, 0.2 ms a step
    policy.observe_step(1, 0.0005, 0, 0.0, burst_forgone=True)  # a single step that proposed
    d = policy.bandit.decay
    assert policy.bandit.rate(1, 0) == pytest.approx((d * 10 + 1) / (d * 0.002 + 0.0002))
    policy.observe_step(1, 0.0005, 0, 0.0)  # a single step that could not have burst counts as it ran
    assert policy.bandit.rate(1, 0) == pytest.approx((d * d * 10 + d + 1) / (d * d * 0.002 + d * 0.0002 + 0.0005))


def test_bandit_changes_depth_on_evidence_not_on_a_few_lucky_steps():
    """With the steps' own spread, a challenger must win by 1.5 standard errors as well as by the margin:
    where two depths run equally fast the best flaps far less, and a real 15 % gain is still played."""
    for seed in range(3):
        assert _noisy_world(1.0, 1.5, seed)[1] < 0.5 * _noisy_world(1.0, 0.0, seed)[1]
        assert _noisy_world(1.15, 1.5, seed)[0] > 0.9
        assert _noisy_world(1.3, 1.5, seed)[0] > 0.95


def test_draft_policy_charges_a_step_its_whole_cycle_but_not_idle_time():
    """A step's cost runs from its start to the next step's start (scheduling and output handling
    included); a gap longer than the step itself is idle time and is left out."""
    policy = DraftPolicy(k_max=4)
    policy.step_started(0.0)
    depth = policy.plan(["a"]).get("a", 0)  # step 1 plans the drafts step 2 verifies
    policy.step_ran(1, 0, 0.0002, started=0.0, ended=0.001)
    policy.step_started(0.0015)  # nothing verified in step 1: nothing to credit
    assert policy.bandit.rate(1, depth) is None
    policy.plan(["a"])
    policy.step_ran(3, 0, 0.0001, started=0.0015, ended=0.0025)
    policy.step_started(0.003)  # cycle 1.5 ms, less its own proposing, plus step 1's proposing
    assert policy.bandit.rate(1, depth) == pytest.approx(3 / (0.0015 - 0.0001 + 0.0002))
    policy.plan(["a"])
    assert policy._verifying == (1, depth, False)  # the first tries all go to depth 0
    policy.step_ran(2, 0, 0.0, started=0.003, ended=0.004)
    policy.step_started(1.0)  # the engine sat idle: only the step's own 1 ms (plus step 2's proposing)
    # decayed sums of tokens over decayed sums of seconds (not a mean of the two steps' rates)
    assert policy.bandit.rate(1, depth) == pytest.approx((0.9 * 3 + 2) / (0.9 * 0.0016 + 0.0011))


def _simulate_admissions(admit_seconds, steps: int = 1500) -> list[int]:
    """Four requests; each draft survives with probability 0.5; a decode step takes 10 ms plus 1 ms per
    depth (drafting 0.5 ms per draft); every tenth step admits a 400-token prompt, which takes
    admit_seconds(drafting) on top (and 5 ms of the draft model's run over it). Returns the depths planned."""
    rng = np.random.default_rng(1)
    policy, depths, plan = DraftPolicy(k_max=4), [], {}
    rids = [f"r{i}" for i in range(4)]
    for step in range(steps):
        verifying, plan = plan, policy.plan(rids)
        depths.append(max(plan.values(), default=0))
        emitted = 0
        for rid in rids:
            k, acc = verifying.get(rid, 0), 0
            while acc < k and rng.random() < 0.5:
                acc += 1
            if k:
                policy.record(rid, k, acc)
            emitted += acc + 1
        depth, drafting = max(verifying.values(), default=0), max(plan.values(), default=0)
        admits = step % 10 == 9
        seconds = 0.010 + 0.001 * depth + (admit_seconds(depth > 0) if admits else 0.0)
        catch_up = 0.005 if admits and drafting else 0.0  # the draft model's run over the new prompt
        policy.observe_step(emitted, seconds, 400 if admits else 0, 0.0005 * drafting + catch_up, catch_up)
    return depths


def test_draft_policy_charges_each_depth_what_admitting_prompts_costs_there():
    """Decode steps alone favour drafts (one draft: 6 tokens in 11.5 ms against 4 in 10 ms). Where admitting a
    prompt costs 90 ms more while drafting (a verification beside a prefill leaves the fast path; the draft
    model prefills the prompt too), no drafts win end to end, and the policy must see it from the steps with
    prefill, which it used to leave out; where admitting costs the same at every depth, drafts still win."""
    late = slice(750, None)
    costly = _simulate_admissions(lambda drafting: 0.12 if drafting else 0.03)
    assert np.mean(np.array(costly[late]) == 0) > 0.9
    even = _simulate_admissions(lambda drafting: 0.03)
    assert np.mean(np.array(even[late]) > 0) > 0.8


def test_placeholder_looks_price_depths_without_running_the_draft_model(llama_dir):
    """A draft model's first drafts after depth 0 cost it a catch-up over every live context, so the adaptive
    policy prices a depth with placeholder drafts instead: the scheduler repeats each request's last token,
    the verification runs them like drafts, and only the target's own first token is kept. Forced to price
    every step, the output is plain decoding's (greedy and seeded sampling), the draft model never runs, no
    draft is counted, and every block comes back."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([10, 23, 7], seed=6)]
    for sp in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
               SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=30, ignore_eos=True)):
        plain = _tokens(make_llm(llama_dir), prompts, sp)
        llm = make_llm(llama_dir, speculative_config=_draft_cfg(llama_dir, k=3))
        core = llm.llm_engine.core
        policy, proposer = core.scheduler.spec, core.runner.proposer
        assert policy.price_looks

        def always_a_look(bucket, acceptance=None):
            policy.bandit.exploring = True
            return 2

        policy.bandit.choose = always_a_look
        policy._judged = [10, 20]  # an acceptance and a draft cost known, as after some real drafting
        policy._draft_cost = {b: 1e-4 for b in (1, 2, 4)}
        priced, proposals = [], []
        record = policy.record_placeholder
        policy.record_placeholder = lambda drafted: (priced.append(drafted), record(drafted))
        propose = proposer.propose_batch
        proposer.propose_batch = lambda runner, items: (proposals.append(items), propose(runner, items))[1]
        assert _tokens(llm, prompts, sp) == plain
        st = _check(llm)
        assert len(priced) > 40 and set(priced) <= {1, 2} and priced.count(2) > 40  # 1 where max_tokens is near
        assert proposals == [] and st.spec_num_draft_tokens == 0
        assert policy._priced and all(d == 2 for _, d in policy._priced)  # and the looks were priced


# -- configuration ------------------------------------------------------------------------------------------------
def test_bad_speculative_configs_are_refused(llama_dir):
    for cfg, why in [({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                     ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
                     ({"method": "ngram"}, "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                       "prompt_lookup_max": 2}, "prompt_lookup_min"),
                     ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
                     ("{not json", "JSON")]:
        with pytest.raises(ValueError, match=why):
            make_llm(llama_dir, speculative_config=cfg)
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens == 3


def test_cli_takes_speculative_config_json():
    import argparse

    from tokenmill.engine.arg_utils import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    args = p.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert SpeculativeConfig.parse(engine_kwargs(args)["speculative_config"]).method == "ngram"


def test_spec_metrics_reach_prometheus_and_the_bench_table(llama_dir):
    from tokenmill.bench.datasets import SampleRequest
    from tokenmill.bench.metrics import format_table
    from tokenmill.bench.offline import run_offline
    from tokenmill.engine.metrics import ServerMetrics

    llm = make_llm(llama_dir, speculative_config=NGRAM)
    reqs = [SampleRequest(p, len(p["prompt_token_ids"]), 30) for p in _repetitive(3)]
    res = run_offline(reqs, engine=llm.llm_engine, ignore_eos=True, disable_tqdm=True, num_warmups=0,
                      sampling={"temperature": 0.0})
    spec = res["spec_decode"]
    assert spec["num_accepted_tokens"] > 0 and 0 < spec["acceptance_rate"] <= 1
    assert "Draft acceptance rate" in format_table(res, ["ttft"], [50.0], "t")
    metrics = ServerMetrics("m")
    metrics.set_engine_stats(llm.llm_engine.get_stats())
    text = metrics.render().decode()
    st = llm.llm_engine.get_stats()
    for name, value in (("num_drafts_total", st.spec_num_drafts), ("num_draft_tokens_total", st.spec_num_draft_tokens),
                        ("num_accepted_tokens_total", st.spec_num_accepted_tokens),
                        ("acceptance_rate", st.spec_acceptance_rate),
                        ("mean_acceptance_length", st.spec_mean_acceptance_length)):
        assert f'tokenmill:spec_decode_{name}{{model_name="m"}} {float(value)}' in text
    per_pos = [f'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}} {float(v)}'
               for i, v in enumerate(st.spec_accepted_per_pos)]
    assert len(per_pos) == 4 and all(line in text for line in per_pos)


# -- the draft-model proposer ------------------------------------------------------------------------------
def _draft_cfg(path, k=4, **kw):
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, **kw}


def test_draft_model_greedy_identity_with_chunking_prefix_hits_and_preemption(llama_dir, model_dirs):
    """The target as its own draft (every draft accepted) and another architecture as a draft that is
    mostly wrong; both must give plain greedy's tokens and give every block back."""
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    shared = random_prompts([40], seed=5)[0]
    prompts = [{"prompt_token_ids": shared + p} for p in random_prompts([9, 17, 30, 5, 12], seed=8)]
    kw = dict(num_kv_blocks=17, max_num_batched_tokens=24, max_model_len=256)
    plain = _tokens(make_llm(llama_dir, **kw), prompts, sp)
    for draft, adaptive in ((llama_dir, False), (model_dirs["mistral"][0], True)):
        llm = make_llm(llama_dir, **kw, speculative_config=_draft_cfg(draft, adaptive=adaptive))
        assert _tokens(llm, prompts, sp) == plain
        st = _check(llm)
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0 and st.spec_num_draft_tokens > 0
        if draft == llama_dir:
            assert st.spec_acceptance_rate > 0.9  # a draft identical to the target is (almost) always right


def test_draft_forward_returns_each_request_its_own_token(llama_dir):
    """The draft's forward runs decode rows before chunks (the attention backend's order) and its argmaxes stay
    on the device; they must come back in the order the requests were given. (Greedy speculation is lossless
    whatever the drafts, so only the drafts themselves show a mix-up.)"""
    from tokenmill.sched.output import ScheduledRequest

    llm = make_llm(llama_dir, speculative_config=_draft_cfg(llama_dir, k=3, adaptive=False))
    eng = llm.llm_engine
    for i, p in enumerate(random_prompts([11, 6, 8], seed=21)):
        eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.step()
    runner = eng.core.runner
    proposer, states = runner.proposer, [runner.requests[str(i)] for i in range(3)]
    ends = [len(st.prompt_token_ids) + len(st.output_token_ids) - 1 for st in states]
    chunk = ScheduledRequest("0", 0, ends[0] + 1, [], 1)  # request 0 over its whole context (a catch-up chunk)
    decodes = [ScheduledRequest(str(i), ends[i], 1, [], 1, draft_token_ids=[states[i].output_token_ids[-1]])
               for i in (1, 2)]
    seqs = [chunk] + decodes
    alone = [proposer._run(runner, [s]).tolist()[0] for s in seqs]
    assert len(set(alone)) == 3  # else a mix-up would not show
    # run order: the decodes, then the chunk ([1, 2, 0], not its own inverse)
    assert proposer._run(runner, seqs).tolist() == alone
    assert proposer._run(runner, [decodes[1], chunk, decodes[0]]).tolist() == [alone[2], alone[0], alone[1]]


def test_draft_model_seeded_sampling_matches_plain(llama_dir):
    """Seeded sampling with a draft model gives the plain engine's tokens. (The tiny random model's distribution
    is flat: at temperature 0.9 a greedy draft matches the sampled token about never, so acceptance is checked
    at 0.3, where drafts do land.)"""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([10, 20], seed=3)]
    spec = make_llm(llama_dir, speculative_config=_draft_cfg(llama_dir, k=3, adaptive=False))
    plain = make_llm(llama_dir)
    for temperature in (0.9, 0.3):
        sp = SamplingParams(temperature=temperature, top_p=0.95, seed=4, max_tokens=30, ignore_eos=True)
        assert _tokens(spec, prompts, sp) == _tokens(plain, prompts, sp)
    assert _check(spec).spec_num_accepted_tokens > 0


def test_bad_draft_models_are_refused(llama_dir, tmp_path):
    import transformers
    from transformers import LlamaConfig

    other = str(tmp_path / "other-vocab")
    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    with pytest.raises(ValueError, match="vocabulary"):
        make_llm(llama_dir, speculative_config=_draft_cfg(other))
    short = str(tmp_path / "short")
    cfg.vocab_size, cfg.max_position_embeddings = 512, 64
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(short)
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(llama_dir, speculative_config=_draft_cfg(short))


def test_speculation_with_kv_tiers(llama_dir, model_dirs):
    """Both proposers on top of host-tier hits: prefixes loaded from the tier carry no draft KV, which the
    draft model's catch-up recomputes; greedy tokens stay those of the plain engine."""
    from tests.test_kv_tiers import POOL, _run, _workload

    plain = _run(make_llm(llama_dir, **POOL), _workload())
    for spec in (NGRAM, _draft_cfg(model_dirs["qwen2"][0], adaptive=False)):
        llm = make_llm(llama_dir, **POOL, kv_host_cache_gb=0.05, speculative_config=spec)
        assert _run(llm, _workload()) == plain
        st = _check(llm)
        assert st.kv_tiers["host"]["hit_tokens"] > 0 and st.spec_num_draft_tokens > 0


@pytest.mark.parametrize("spec", ["ngram", "draft_model"])
def test_speculation_under_tensor_parallelism_is_token_identical(llama_dir, greedy_reference, spec):
    """Every TP rank proposes the same drafts (prompt lookup, or a replicated draft model) and verifies them
    on the same all-gathered logits."""
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    cfg = NGRAM if spec == "ngram" else _draft_cfg(llama_dir, k=3, adaptive=False)
    llm = make_llm(llama_dir, tensor_parallel_size=2, allow_cpu_oversubscription=True, speculative_config=cfg)
    try:
        assert _tokens(llm, _repetitive(6), sp) == greedy_reference
        assert _check(llm).spec_num_accepted_tokens > 0
    finally:
        llm.llm_engine.core.close()


def test_a_preemption_in_a_step_that_schedules_nothing_reaches_the_worker_and_the_draft(llama_dir):
    """The scheduler may preempt a request and schedule nothing (the free blocks are held by a KV tier load or a
    step in flight): the runner must still forget the request's blocks and the draft model how far its draft KV
    was valid, which the resumed request's new blocks do not hold. It then resumes with plain greedy's tokens
    and keeps its drafts accepted (the target is its own draft: every draft on a valid draft KV is)."""
    from tokenmill.sched.output import SchedulerOutput

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([20], seed=9)[0]}
    want = _tokens(make_llm(llama_dir), [prompt], sp)[0]
    llm = make_llm(llama_dir, speculative_config=_draft_cfg(llama_dir, k=3, adaptive=False))
    engine = llm.llm_engine
    core, runner = engine.core, engine.core.runner
    engine.add_request("r", prompt, sp)
    for _ in range(3):
        engine.step()
    assert "r" in runner.proposer._synced and runner.requests["r"].block_ids
    sched, real = core.scheduler, core.scheduler.schedule

    def preempt_and_schedule_nothing():
        sched.schedule = real
        out = SchedulerOutput()
        sched._preempt(sched.requests["r"], out)
        return out
    sched.schedule = preempt_and_schedule_nothing
    assert engine.step() == []
    assert "r" not in runner.proposer._synced and runner.requests["r"].block_ids == []
    before = engine.get_stats()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == want
    after = _check(llm)
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert drafted > 0 and after.spec_num_accepted_tokens - before.spec_num_accepted_tokens == drafted
