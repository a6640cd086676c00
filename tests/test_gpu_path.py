"""The GPU path, as far as a CPU can check it: the Triton attention backend in the whole engine (under
Triton's interpreter) against the torch backend, its fallback when the kernels cannot run, device and
backend selection, and the worst-case step that sizes a GPU's KV cache. benchmarks/gpu_check.py covers
the rest on a GPU."""
from __future__ import annotations

import functools
import logging
import os
import sys
import types

import pytest
import torch

from conftest import make_llm, random_prompts
from tokenmill.attention.registry import attention_backend_class, resolve_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.memory_profile import GpuMemoryBudget, WorstCase, worst_case_lengths
from triton_child import child_main, needs_triton, run_child

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# chunked prefill (a 20-token budget splits the 40-token prompts), prefix hits (prompts 0-2 share 32
# tokens, two full blocks), a one-token prompt, a prompt ending on a block boundary (32), and preemption
# (16 blocks of 16 tokens cannot hold five sequences growing to ~80 tokens)
_SHARED = random_prompts([32], seed=5)[0]
PROMPTS = ([_SHARED + p for p in random_prompts([8, 3, 9], seed=6)] + random_prompts([1, 32, 40, 17], seed=7))
# padded-graphs: decode steps go through worker/cuda_graphs.py's persistent, padded buffers (run eagerly,
# as a CPU cannot capture); buckets 1, 2, 4, 5, so 3-row steps carry a padding row with slot -1
SCENARIOS = {
    "chunked+prefix": dict(max_num_batched_tokens=20, enable_prefix_caching=True),
    "preemption": dict(num_kv_blocks=16, max_model_len=96, max_num_seqs=5, max_tokens=40),
    "padded-graphs": dict(max_num_seqs=5, graphs=True),
    # the same with async scheduling: the decode inputs are staged in the graphs' buffers and the tokens the step
    # before sampled are filled in there on the device
    "padded-graphs-async": dict(max_num_seqs=5, graphs=True, async_scheduling=True),
    # draft-model speculation (the target as its own draft) with the draft's steps in padded buffers of their
    # own, as its CUDA graphs on a GPU; lossless, so the tokens are padded-graphs' torch run's
    "draft-graphs": dict(max_num_seqs=5, graphs=True, draft_k=3),
    # the fused rotary + KV-write launch raises at the first layer: rotary and write_kv run apart from then
    # on, attention stays on Triton
    "fused-launch-fails": dict(max_num_batched_tokens=20, break_fused=True),
    # ops/triton_gemv.py folded into the layers (TOKENMILL_TRITON_GEMV=1): decode steps of <= 8 rows and short
    # chunks take the folded GEMVs, longer prefill chunks the plain ops (float weights kept: no CPU repacking)
    "folded-gemvs": dict(max_num_batched_tokens=20, fold_gemvs=True, cpu_linear_kernel="torch"),
}
TORCH_RUN = {"fused-launch-fails": "chunked+prefix", "folded-gemvs": "chunked+prefix",  # shared torch runs
             "padded-graphs-async": "padded-graphs", "draft-graphs": "padded-graphs"}


def _padded_graphs(llm, model, backend, kv_caches):
    """worker/cuda_graphs.py's buffers over `model`, run eagerly (a CPU cannot capture)."""
    from tokenmill.worker.cuda_graphs import DecodeGraphs
    cfg = llm.llm_engine.config
    return DecodeGraphs(model, backend, kv_caches, cfg.max_num_seqs, cfg.max_model_len, cfg.block_size, "cpu",
                        capture=False)


def _generate(model_dir: str, backend: str, graphs: bool = False, max_tokens: int = GREEDY.max_tokens,
              break_fused: bool = False, fold_gemvs: bool = False, draft_k: int = 0, **kw) -> dict:
    if fold_gemvs:
        from tokenmill.ops import triton_gemv
        os.environ[triton_gemv.ENABLE_ENV] = "1"
        try:
            return _generate(model_dir, backend, graphs, max_tokens, **kw)
        finally:
            del os.environ[triton_gemv.ENABLE_ENV]
    if break_fused:
        from tokenmill.ops import triton_attention
        real = triton_attention.rotary_write_kv

        def broken(*a, **k):
            raise RuntimeError("no kernel image for this device")
        triton_attention.rotary_write_kv = broken
        try:
            return _generate(model_dir, backend, graphs, max_tokens, **kw)
        finally:
            triton_attention.rotary_write_kv = real
    if draft_k:
        kw["speculative_config"] = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": draft_k,
                                    "adaptive": False}
    llm = make_llm(model_dir, attention_backend=backend, **kw)
    runner = llm.llm_engine.core.runner
    draft = runner.proposer if draft_k and backend == "triton" else None
    if draft is not None:
        draft.decode_step = _padded_graphs(llm, draft.model, draft.backend, draft.kv_caches)
    if graphs and backend == "triton":
        runner.decode_step = _padded_graphs(llm, runner.model, runner.backend, runner.kv_caches)
        runner.decode_step.steps = 0
        run = runner.decode_step.run

        def counted(*a):
            runner.decode_step.steps += 1
            return run(*a)
        runner.decode_step.run = counted
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    runner_backend = llm.llm_engine.core.runner.backend
    return dict(tokens=[o.outputs[0].token_ids for o in outs], backend=type(runner_backend).__name__,
                graph_steps=getattr(runner.decode_step, "steps", 0), deferred_steps=runner.num_deferred_steps,
                staged_steps=getattr(runner.decode_step, "num_staged_steps", 0),
                pending_fills=sum(runner.num_pending_fills),
                failure=getattr(runner_backend, "failure", None), preemptions=stats.num_preemptions,
                fused=getattr(runner_backend, "fuse_rotary_kv", None),
                folded=[layer.folds_gemvs for layer in runner.model.model.layers],
                prefix_hits=stats.prefix_cache_hits, drafts=stats.spec_num_draft_tokens,
                accepted=stats.spec_num_accepted_tokens,
                draft_graph_steps=draft.decode_step.num_runs if draft is not None else 0,
                draft_staged_steps=draft.decode_step.num_staged_steps if draft is not None else 0)


# ------------------------------------------------------------------ the interpreter child


def _child_main(mode: str, model_dir: str) -> None:
    # the interpreted (slow) runs first, so that the children's shards take turns at them (triton_child.run_child)
    child_main({f"{backend}-{name}": functools.partial(_generate, model_dir, backend, **kw)
                for backend in ("triton", "torch") for name, kw in SCENARIOS.items()
                if backend == "triton" or name not in TORCH_RUN})


# ------------------------------------------------------------------ the pytest side


@pytest.fixture(scope="module")
def interpreted(llama_dir) -> dict:
    return run_child(__file__, "interpret", timeout=500, extra_args=[llama_dir])  # inside pytest-timeout's 600 s


@needs_triton
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_triton_engine_matches_torch_backend(interpreted, scenario):
    torch_run = interpreted[f"torch-{TORCH_RUN.get(scenario, scenario)}"]
    triton_run = interpreted[f"triton-{scenario}"]
    for r in (torch_run, triton_run):
        assert "exception" not in r, r.get("exception")
    assert triton_run["backend"] == "TritonAttentionBackend" and triton_run["failure"] is None, triton_run["failure"]
    assert triton_run["fused"] is (scenario != "fused-launch-fails")  # the one-launch rotary + KV write ran
    assert triton_run["tokens"] == torch_run["tokens"]
    assert all(len(t) == SCENARIOS[scenario].get("max_tokens", GREEDY.max_tokens) for t in triton_run["tokens"])
    if scenario == "preemption":
        assert triton_run["preemptions"] > 0
    elif scenario == "fused-launch-fails":
        pass  # same tokens, no Triton attention failure, fusion switched off: asserted above
    elif scenario == "folded-gemvs":
        assert triton_run["folded"] == [True] * len(triton_run["folded"])
        assert not any(torch_run["folded"])  # (None: never decided, the CPU's one-call step ran the decodes)
    elif scenario == "draft-graphs":  # the draft's single-token steps ran in its own padded buffers (the target's
        # verifications, 4 rows a request, mostly exceed the 5-row buckets)
        assert triton_run["drafts"] > 0 and triton_run["draft_graph_steps"] > 0
        assert triton_run["draft_staged_steps"] == triton_run["draft_graph_steps"]  # staged into the draft's mirror
        # tokens are lossless whatever the drafts: the target drafting for itself must be (almost) always right
        assert triton_run["accepted"] > 0.9 * triton_run["drafts"]
    elif scenario.startswith("padded-graphs"):
        assert triton_run["graph_steps"] >= GREEDY.max_tokens - 1  # the decode steps took the padded path
        assert triton_run["staged_steps"] == triton_run["graph_steps"]  # each staged straight into the buffers
        if scenario.endswith("async"):  # tokens stayed on the device and were filled into the graphs' inputs
            assert triton_run["deferred_steps"] > 0 and triton_run["pending_fills"] > 0
    else:
        assert triton_run["prefix_hits"] >= 2 * 32  # prompts 1 and 2 reuse prompt 0's two shared blocks


@needs_triton
def test_triton_backend_falls_back_to_torch_when_kernels_cannot_run(llama_dir, caplog, monkeypatch):
    """On a CPU without the interpreter the kernels cannot launch: one warning, then torch, same tokens."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with caplog.at_level(logging.WARNING):
        llm = make_llm(llama_dir, attention_backend="triton")
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
    backend = llm.llm_engine.core.runner.backend
    assert type(backend).__name__ == "TritonAttentionBackend" and backend.failure and not backend.fuse_rotary_kv
    assert sum("serving with the torch attention backend" in r.message for r in caplog.records) == 1
    assert sum("fused rotary + KV write failed" in r.message for r in caplog.records) == 1
    want = make_llm(llama_dir, attention_backend="torch").generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert got == [o.outputs[0].token_ids for o in want]


def test_device_and_backend_selection(llama_dir, monkeypatch):
    cfg = EngineConfig(model=llama_dir)
    if torch.cuda.is_available():
        assert cfg.device == "cuda" and cfg.attention_backend in ("triton", "torch")
    else:
        assert (cfg.device, cfg.attention_backend) == ("cpu", "torch")
    assert EngineConfig(model=llama_dir, attention_impl="eager").attention_backend == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_attention_backend("auto", "cpu") == "torch"
    assert resolve_attention_backend("triton", "cpu") == "triton"  # asked for: honoured (and may fall back)
    with pytest.raises(ValueError, match="choose from"):
        attention_backend_class("flash")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model=llama_dir, attention_backend="flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_asked_for_but_absent(llama_dir):
    with pytest.raises(ValueError, match="device='cuda' was asked for, but torch sees no CUDA GPU"):
        EngineConfig(model=llama_dir, device="cuda")


def test_worst_case_step_shape():
    assert worst_case_lengths(2048, 256, 4096) == [8] * 256  # every sequence samples: the most logits rows
    assert worst_case_lengths(10, 4, 100) == [3, 3, 2, 2]
    assert worst_case_lengths(100, 1, 40) == [34, 33, 33]  # no prompt longer than max_model_len
    assert sum(worst_case_lengths(2049, 7, 4096)) == 2049


def test_worst_case_step_runs_through_the_runner(llama_dir):
    """The profiling step is a real step: it runs on a scratch cache and leaves no request state behind."""
    llm = make_llm(llama_dir)
    core = llm.llm_engine.core
    made = []

    def make_runner(num_blocks):
        from tokenmill.worker.model_runner import ModelRunner
        r = core.runner
        made.append(ModelRunner(r.model, r.backend, num_blocks, r.block_size, len(r.kv_caches),
                                r.kv_cache.shape[-2], r.kv_cache.shape[-1], r.dtype, "cpu"))
        return made[-1]

    WorstCase.for_limits(64, 8, 256, 16).run(make_runner)
    assert made[0].num_blocks == 8 and len(made[0].requests) == 0
    assert made[0].kv_cache.abs().sum() > 0  # the step wrote its keys
    # one sequence as long as the budget allows, verifying 3 drafts: inside max_model_len (256) and its rotary table
    WorstCase.for_limits(256, 1, 256, 16, num_drafts=3).run(make_runner)
    assert len(made[1].requests) == 0


def test_worst_case_verification_stays_inside_the_scheduler_limits():
    """As the scheduler's _fit_drafts: positions n .. n + k inside max_model_len and k + 1 rows inside the
    token budget; no verification step where no sequence has room (a step of no sequences would fail)."""
    def rows(worst):
        step = worst.verification(worst.prefill())
        if step is None:
            return None
        assert all(s.start_pos + s.num_new_tokens <= worst.max_model_len for s in step.seqs)
        assert step.num_scheduled_tokens <= sum(worst.lengths)
        return [s.num_new_tokens for s in step.seqs]

    assert rows(WorstCase.for_limits(64, 8, 256, 16, num_drafts=3)) == [4] * 8
    assert rows(WorstCase.for_limits(256, 1, 256, 16, num_drafts=3)) == [4, 4]  # prompts leave room for k + 1
    assert rows(WorstCase.for_limits(2048, 2, 1024, 16, num_drafts=4)) == [5, 5, 5]  # 3 prompts of <= 1019
    assert rows(WorstCase([256], 16, 256, num_drafts=3)) is None  # a full-length prompt cannot verify
    assert rows(WorstCase([254], 16, 256, num_drafts=3)) == [2]  # one draft fits before max_model_len
    assert rows(WorstCase([2], 16, 256, num_drafts=3)) == [2]  # a budget of 2 tokens: one draft
    assert rows(WorstCase([5, 5, 5], 16, 256, num_drafts=4)) == [5, 5, 5]
    assert rows(WorstCase([1, 1, 1], 16, 256, num_drafts=4)) == [3]  # the budget (3 tokens) runs out
    assert WorstCase([16, 16], 16, 256, num_drafts=3).scratch_blocks == 4  # room past a full block


@pytest.mark.parametrize("with_draft_model", [False, True])
def test_worst_case_steps_exercise_the_whole_sampler(llama_dir, monkeypatch, with_draft_model):
    """The GPU's KV sizing reads the profile steps' peak, so they must make the sampler's biggest temporaries:
    every row filtered by top-k, top-p and min-p, penalized, with logprobs; prompt logprobs; and with
    speculative decoding a verification of k + 1 rows per sequence, as many as the token budget allows."""
    import tokenmill.sample.sampler as sampler_mod
    import tokenmill.worker.model_runner as runner_mod

    spec = {"method": "draft_model", "model": llama_dir, "num_speculative_tokens": 3, "adaptive": False}
    llm = make_llm(llama_dir, **({"speculative_config": spec} if with_draft_model else {}))
    r = llm.llm_engine.core.runner
    mc = llm.llm_engine.core.model_config
    seen = {"filter": [], "penalize": [], "verify": [], "prompt_lp": [], "lp": []}

    def spy(name, fn, rows_of):
        def wrapped(*args, **kw):
            seen[name].append(rows_of(*args, **kw))
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(sampler_mod, "filter_logits",
                        spy("filter", sampler_mod.filter_logits, lambda x, *a, **k: (x.shape[0],) + a[3:]))
    monkeypatch.setattr(sampler_mod, "_penalize", spy("penalize", sampler_mod._penalize, lambda x, idx, sub: len(idx)))
    monkeypatch.setattr(sampler_mod, "token_logprob_tensors",
                        spy("lp", sampler_mod.token_logprob_tensors, lambda lps, chosen, n: (lps.shape[0], n)))
    monkeypatch.setattr(runner_mod, "verify", spy("verify", runner_mod.verify, lambda s, logits, c: logits.shape[0]))
    monkeypatch.setattr(runner_mod, "token_logprob_tensors",
                        spy("prompt_lp", runner_mod.token_logprob_tensors, lambda lps, t, n: (lps.shape[0], n)))

    def make_runner(num_blocks):
        from tokenmill.spec_decode.build import build_proposer
        from tokenmill.worker.model_runner import ModelRunner
        proposer = None
        if with_draft_model:  # as worker/build.py makes it: the draft's KV in the scratch runner's blocks
            proposer = build_proposer(llm.llm_engine.config.speculative, (r.proposer.model, mc), num_blocks,
                                      r.block_size, r.dtype, "cpu", r.backend)
        return ModelRunner(r.model, r.backend, num_blocks, r.block_size, len(r.kv_caches), r.kv_cache.shape[-2],
                           r.kv_cache.shape[-1], r.dtype, "cpu", proposer=proposer)

    proposed = []
    if with_draft_model:  # the draft's catch-up over every whole prompt, then its steps: its largest forwards
        from tokenmill.spec_decode.draft_model import DraftModelProposer
        real = DraftModelProposer.propose_batch
        monkeypatch.setattr(DraftModelProposer, "propose_batch", lambda self, runner, items: proposed.append(
            [(s.num_new_tokens, s.propose_k) for s, _ in items]) or real(self, runner, items))
    # 8 sequences of 16 tokens: the verification's positions 16 .. 19 are in a block of their own
    WorstCase.for_limits(128, 8, 256, 16, num_drafts=3).run(make_runner)
    assert proposed == ([[(16, 3)] * 8] if with_draft_model else [])
    # the prefill samples 8 rows; the verification 8 sequences x 4 rows
    assert seen["filter"] == [(8, True, True, True), (32, True, True, True)]
    assert seen["penalize"] == [8, 32]
    assert seen["verify"] == [32]
    assert (8, 20) in seen["lp"] and seen["prompt_lp"] == [(15, 20)]  # the longest prompt scores its 15 next tokens


def test_gpu_budget_and_the_not_enough_memory_error(llama_dir):
    from tokenmill.config import ModelConfig
    from tokenmill.models.loader import load_hf_config
    from tokenmill.worker.build import num_kv_blocks

    budget = GpuMemoryBudget(total=80 * 2**30, utilization=0.9, used=70 * 2**30, activation_peak=2 * 2**30)
    assert budget.kv_bytes == 0
    cfg = EngineConfig(model=llama_dir, max_model_len=256)
    mc = ModelConfig.from_hf(load_hf_config(llama_dir))
    cfg.resolve(mc)
    cfg.device = "cuda"  # as if on a GPU: the budget decides
    with pytest.raises(ValueError, match=r"not enough GPU memory for one 256-token sequence.*0.00 GiB"):
        num_kv_blocks(cfg, mc, torch.float32, 2, 2, budget=budget)
    roomy = GpuMemoryBudget(total=80 * 2**30, utilization=0.9, used=10 * 2**30, activation_peak=2 * 2**30)
    per_block = 2 * 2 * 16 * 2 * mc.head_dim * 4  # k and v, 2 layers, 16 tokens, 2 kv heads, float32
    # every sequence at full length, plus one: more would only hold cached prefixes (and host objects)
    cap = cfg.max_num_seqs * 16 + 16
    assert roomy.kv_bytes // per_block > cap
    assert num_kv_blocks(cfg, mc, torch.float32, 2, 2, budget=roomy) == cap
    tight = GpuMemoryBudget(total=80 * 2**30, utilization=0.9, used=72 * 2**30 - 2**24, activation_peak=0)
    assert num_kv_blocks(cfg, mc, torch.float32, 2, 2, budget=tight) == tight.kv_bytes // per_block < cap



def test_graph_buffers_take_staged_rows_and_reset_the_padding():
    """DecodeGraphs.host_rows + commit put a decode step's host rows into the graphs' buffers (through a host
    mirror, one copy), run() replays them as they are, and the padding rows an earlier, larger step left are
    reset (token and position 0, slot -1, length 1). The same step copied in by run() (prepared elsewhere)
    fills the same buffers."""
    from tokenmill.attention.backend import AttentionBatch
    from tokenmill.worker.cuda_graphs import DecodeGraphs
    graphs = DecodeGraphs(None, None, None, max_num_seqs=8, max_model_len=64, block_size=16, device="cpu",
                          capture=False)
    seen = []

    def forward(size):  # what a replay of bucket `size` would read
        seen.append((graphs.longs[:, :size].tolist(), graphs.seq_lens[:size].tolist(),
                     graphs.query_start_loc[:size + 1].tolist(), graphs.block_tables[:size].tolist()))
        return torch.zeros(size, 2)
    graphs._forward = forward

    def step(rows: int, width: int, staged: bool):
        ids, pos, slots = [7 + r for r in range(rows)], [20 + r for r in range(rows)], [40 + r for r in range(rows)]
        lens = [21 + r for r in range(rows)]
        tables = [b for r in range(rows) for b in range(r + 1, r + 1 + width)]
        longs = torch.tensor(ids + pos + slots)
        ints = torch.tensor(lens + tables, dtype=torch.int32)
        if staged:
            host_longs, host_lens, host_tables = graphs.host_rows(rows)
            host_longs[:, :rows] = longs.view(3, rows).numpy()
            host_lens[:rows] = lens
            host_tables[:rows, :width] = ints[rows:].view(rows, width).numpy()
            ids_t, pos_t, slot_t, qsl_t, lens_t, tables_t = graphs.commit(rows, width)
            assert ids_t.data_ptr() == graphs.input_ids.data_ptr()
        else:
            ids_t, pos_t, slot_t = longs[:rows], longs[rows:2 * rows], longs[2 * rows:]
            qsl_t, lens_t = torch.arange(rows + 1, dtype=torch.int32), ints[:rows]
            tables_t = ints[rows:].view(rows, width)
        batch = AttentionBatch(slot_t, qsl_t, lens_t, tables_t, num_decodes=rows, max_seq_len=max(lens),
                               max_query_len=1, query_start_loc_host=list(range(rows + 1)), seq_lens_host=lens)
        assert graphs.can_stage(rows, width) and graphs.can_run(batch, rows)
        staged_before = graphs.num_staged_steps
        assert graphs.run(ids_t, pos_t, batch).shape == (rows, 2)
        assert graphs.num_staged_steps == staged_before + staged  # run() found a staged step's rows in place
        return seen[-1]

    for staged in (True, False):
        first = step(5, 3, staged)  # bucket 8: rows 5-7 are padding from the start
        assert first[0] == [[7, 8, 9, 10, 11, 0, 0, 0], [20, 21, 22, 23, 24, 0, 0, 0], [40, 41, 42, 43, 44, -1, -1, -1]]
        assert first[1] == [21, 22, 23, 24, 25, 1, 1, 1] and first[2] == list(range(9))
        assert first[3][4][:3] == [5, 6, 7] and first[3][5] == [0] * 4
        second = step(3, 2, staged)  # bucket 4: row 3 held the first step's fourth row
        assert second[0] == [[7, 8, 9, 0], [20, 21, 22, 0], [40, 41, 42, -1]]
        # a padding row's table: zeros when copied in; a staged step copies only its own rows, so row 3 keeps
        # the first step's blocks (real ids: its one key read is of a real block)
        assert second[1] == [21, 22, 23, 1] and second[3][3] == ([4, 5, 6, 0] if staged else [0] * 4)
        assert second[3][2][:2] == [3, 4]  # columns past this step's width keep what they held: never read
        graphs.filled = 0  # a fresh start for the copied-in variant
        graphs.longs[:2].zero_()
        graphs.slot_mapping.fill_(-1)
        graphs.seq_lens.fill_(1)
        graphs.block_tables.zero_()



def test_graph_buffer_mirrors_keep_their_own_padding():
    """A ring of host mirrors (a GPU's: the host fills the next while a copy from the last is queued), each with
    the padding of its own history: whatever sequence of step sizes comes, a replay of bucket b reads this
    step's rows and then padding (token and position 0, slot -1, length 1), with every table entry a block id
    some step wrote (or 0), never a stale token or slot."""
    import random

    from tokenmill.worker.cuda_graphs import DecodeGraphs, _Mirror
    graphs = DecodeGraphs(None, None, None, max_num_seqs=16, max_model_len=64, block_size=16, device="cpu",
                          capture=False)
    graphs._mirrors = [_Mirror(graphs) for _ in range(3)]
    seen = []
    graphs._forward = lambda size: seen.append((size, graphs.longs[:, :size].tolist(),
                                                graphs.seq_lens[:size].tolist(),
                                                graphs.block_tables[:size].tolist())) or torch.zeros(size, 2)
    rng = random.Random(0)
    for step in range(60):
        rows, width = rng.randint(1, 16), rng.randint(1, 4)
        ids = [1000 + step * 20 + r for r in range(rows)]
        host_longs, host_lens, host_tables = graphs.host_rows(rows)
        host_longs[:, :rows] = [ids, [500 + r for r in range(rows)], [r for r in range(rows)]]
        host_lens[:rows] = [2 + r for r in range(rows)]
        host_tables[:rows, :width] = [[100 + c for c in range(width)]] * rows
        views = graphs.commit(rows, width)
        batch = types.SimpleNamespace(num_decodes=rows, num_seqs=rows, block_tables=views[5])
        assert graphs.can_run(batch, rows)
        graphs.run(views[0], views[1], batch)
        size, longs, lens, tables = seen[-1]
        pad = size - rows
        assert longs == [ids + [0] * pad, [500 + r for r in range(rows)] + [0] * pad, list(range(rows)) + [-1] * pad]
        assert lens == [2 + r for r in range(rows)] + [1] * pad
        assert all(row[:width] == [100 + c for c in range(width)] for row in tables[:rows])
        assert all(b == 0 or 100 <= b < 104 for row in tables for b in row)


def test_speculative_decoding_starts_over_decode_graphs(llama_dir, monkeypatch):
    """The draft policy bounds a step's rows by the captured decode step's (CUDA graphs: the largest bucket);
    an engine with speculation over decode graphs used to fail at startup (no max_rows)."""
    from tokenmill.worker import build
    from tokenmill.worker.cuda_graphs import DecodeGraphs

    def graphs(config, model, backend, kv_caches):
        return DecodeGraphs(model, backend, kv_caches, config.max_num_seqs, config.max_model_len, config.block_size,
                            "cpu", capture=False)
    monkeypatch.setattr(build, "captured_decode_step", graphs)
    llm = make_llm(llama_dir, max_num_seqs=12, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    core = llm.llm_engine.core
    assert isinstance(core.runner.decode_step, DecodeGraphs)
    assert core.scheduler.spec.max_rows == core.runner.decode_step.max_rows == 12  # buckets 1, 2, 4, 8, 12


@needs_triton
def test_graph_warm_up_survives_a_triton_failure(llama_dir, monkeypatch):
    """The graphs' warm-up is where a Triton compile failure first shows: the backend falls back to torch and
    redoes the layer, whose write_kv takes no padding slot -1 (a device-side assert that would end the CUDA
    context at startup). The warm-up's rows write real slots instead; the padding is -1 again after it."""
    from tokenmill.worker.cuda_graphs import DecodeGraphs
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the kernels cannot launch on a CPU: they fail
    llm = make_llm(llama_dir, attention_backend="triton", enforce_eager=True)
    runner = llm.llm_engine.core.runner
    graphs = DecodeGraphs(runner.model, runner.backend, runner.kv_caches, 4, 64, 16, "cpu", capture=False)
    graphs._warm_up(4)
    assert runner.backend.failure and not runner.backend.cuda_graph_safe
    assert graphs.slot_mapping.tolist() == [-1] * 4


def test_bursts_do_not_turn_async_scheduling_off_on_a_gpu(llama_dir):
    """A GPU ignores num_scheduler_steps (the CPU's one-call step runs bursts), so it must not block async
    scheduling there."""
    from tokenmill.config import ModelConfig
    from tokenmill.models.loader import load_hf_config
    mc = ModelConfig.from_hf(load_hf_config(llama_dir))
    cfg = EngineConfig(model=llama_dir, num_scheduler_steps=8)
    cfg.device = "cuda"
    cfg._resolve_async_scheduling(mc)
    assert cfg.async_scheduling
    cpu = EngineConfig(model=llama_dir, num_scheduler_steps=8, device="cpu")
    cpu._resolve_async_scheduling(mc)
    assert not cpu.async_scheduling


def _list_index_sites(llm, prompts, params) -> dict:
    """Where tokenmill indexed a tensor with a Python list while `llm` generated (file:line -> count)."""
    import collections
    import traceback

    from torch.overrides import TorchFunctionMode

    sites = collections.Counter()

    class ListIndexSpy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
                idx = args[1]
                if isinstance(idx, list) or (isinstance(idx, tuple) and any(isinstance(i, list) for i in idx)):
                    ours = [f for f in traceback.extract_stack()[:-1] if "/tokenmill/" in f.filename]
                    sites[f"{ours[-1].filename.rsplit('/tokenmill/', 1)[-1]}:{ours[-1].lineno}" if ours else "?"] += 1
            return func(*args, **(kwargs or {}))

    with ListIndexSpy():
        llm.generate(prompts, params, use_tqdm=False)
    return dict(sites)


@pytest.mark.parametrize("engine", ["async", "draft_model", "ngram"])
def test_steps_never_index_a_tensor_with_a_list(llama_dir, engine):
    """`t[list]` and `t[list] = v` on a CUDA tensor copy the list to the device and synchronize the stream first,
    stalling the host behind the step in flight (async scheduling's overlap lost for that step; a draft model's
    steps serialized). Every step kind runs here: decodes with logprobs, prefill chunks among decodes (rows that
    are not consecutive), seeded next to unseeded sampling, penalties, prompt logprobs, a draft model's
    proposals (its catch-up chunks reordered behind decode rows), verifications."""
    kw = {"async": dict(async_scheduling=True),
          "draft_model": dict(speculative_config={"method": "draft_model", "model": llama_dir,
                                                  "num_speculative_tokens": 3, "adaptive": False}, enforce_eager=True),
          "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                            "prompt_lookup_max": 2, "adaptive": False})}[engine]
    llm = make_llm(llama_dir, max_num_batched_tokens=16, **kw)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([30, 9, 17, 5], seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, presence_penalty=0.5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, prompt_logprobs=2, max_tokens=12, ignore_eos=True)]
    assert _list_index_sites(llm, prompts, params) == {}


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])


def test_pinned_ring_takes_its_buffers_in_turn():
    """Deferred steps' tokens come back through a ring of host buffers: within `depth` copies each has its own
    buffer (a copy still queued is never overwritten), then they are reused (no allocation per step), and a
    buffer grows for a larger step."""
    from tokenmill.device_copy import PinnedRing
    ring = PinnedRing(depth=3, pin=False)  # pinned memory needs CUDA; the turn-taking is the same
    steps = [torch.arange(n, dtype=torch.int64) * 7 + n for n in (5, 5, 5, 5, 90, 3)]
    hosts = [ring.copy(t) for t in steps]
    assert all(torch.equal(h, t) for h, t in zip(hosts[3:], steps[3:]))  # later copies may overwrite earlier
    ptrs = [h.data_ptr() for h in hosts]
    assert len(set(ptrs[:3])) == 3  # three copies alive at once: three buffers
    assert ptrs[3] == ptrs[0]  # the fourth reuses the first's buffer
    assert ptrs[4] != ptrs[1] and hosts[4].shape == (90,)  # it grew for 90 tokens
    assert ptrs[5] == ptrs[2]
    assert ring.copy(torch.ones(2, 4, dtype=torch.float32)).shape == (2, 4)  # another dtype: its own buffer


def test_tensor_parallel_ranks_profile_their_kv_cache_and_pipeline_stages_take_the_bound(llama_dir):
    """Every rank that holds all the layers runs the worst-case step on CUDA (TP ranks together, so their
    all-reduces pair up); a pipeline stage cannot run a step alone. TP used to take the rough bound too,
    because the distributed path always hands the runner a pipeline link, neighbours or not."""
    from tokenmill.distributed.comm import WHOLE_MODEL, ModelShard, TensorParallel
    from tokenmill.worker.build import profiles_kv_cache

    cfg = EngineConfig(model=llama_dir, max_model_len=256)
    cfg.device = "cuda"
    tp_rank = ModelShard(TensorParallel(1, 2))
    assert profiles_kv_cache(cfg, WHOLE_MODEL) and profiles_kv_cache(cfg, tp_rank)
    assert not profiles_kv_cache(cfg, ModelShard(TensorParallel(0, 2), is_last_stage=False))
    assert not profiles_kv_cache(cfg, ModelShard(is_first_stage=False))
    cfg.num_kv_blocks = 64
    assert not profiles_kv_cache(cfg, WHOLE_MODEL)
    cfg.num_kv_blocks, cfg.device = None, "cpu"
    assert not profiles_kv_cache(cfg, tp_rank)
