"""Tensor and pipeline parallelism on CPU with gloo: every split gives the tokens of a single process
(greedy and seeded sampling, structured outputs, with chunked prefill, prefix hits and preemption), a dead worker ends the
engine with an error, and sizes the model cannot split over are refused before any process starts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tokenmill import SamplingParams
from tokenmill.distributed.executor import WorkerFailure
from conftest import make_llm, random_prompts
from server_fixtures import ServerProcess, core_pid, tiny_model_dir  # noqa: F401  (fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
LONGER = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# structured outputs: each sampling rank walks its own matcher over the same tokens
REGEX = SamplingParams(temperature=0.8, seed=3, max_tokens=20, structured_outputs={"regex": "[a-c]{2,5}-[0-9]{1,3}"})
# chunked prefill (16-token budget), prefix hits (the second pass over SHARED), preemption (the four
# DISTINCT prompts fit in 10 blocks, their 20-token decodes do not)
ENGINE = dict(max_num_batched_tokens=16, num_kv_blocks=10, max_model_len=64, allow_cpu_oversubscription=True)
SHARED = [random_prompts([24], seed=6)[0] + tail for tail in random_prompts([3, 9, 5], seed=7)]
DISTINCT = random_prompts([30, 41, 25, 36], seed=10)


def run(llm) -> dict:
    def gen(prompts, params):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    out = {"shared": gen(SHARED, GREEDY), "shared_again": gen(SHARED, GREEDY), "distinct": gen(DISTINCT, LONGER),
           "seeded": gen(SHARED[:2], SEEDED), "regex": gen(DISTINCT[:2], REGEX)}
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_preemptions > 0, stats
    llm.llm_engine.check_invariants()
    return out


def close(llm) -> None:
    llm.llm_engine.core.close()


@pytest.fixture(scope="module")
def expected(model_dirs, awq_checkpoint):
    """The single-process engine's tokens per model."""
    out = {}
    for name, path in (("llama", model_dirs["llama"][0]), ("qwen2", model_dirs["qwen2"][0]), ("awq", awq_checkpoint)):
        llm = make_llm(path, **ENGINE)
        out[name] = run(llm)
    return out


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    from awq_oracle import autoawq_linear_class, write_autoawq_checkpoint
    from conftest import build_model

    if autoawq_linear_class() is None:
        pytest.skip("autoawq is a test dependency")
    root = tmp_path_factory.mktemp("awq-tp")
    build_model(str(root / "float"), "llama", seed=3)
    write_autoawq_checkpoint(str(root / "float"), str(root / "awq"), 32)  # o_proj's 32 columns per rank: 1 group
    return str(root / "awq")


@pytest.mark.parametrize("name,tp,pp,allreduce", [
    ("llama", 2, 1, "auto"), ("llama", 1, 2, "auto"), ("llama", 2, 2, "auto"),  # Llama, GQA (4 heads, 2 KV)
    ("llama", 2, 1, "gloo"),                             # TP collectives through torch.distributed only
    ("qwen2", 2, 1, "auto"), ("qwen2", 1, 2, "auto"),    # QKV bias, tied embeddings (on both stages)
    ("awq", 2, 1, "auto"), ("awq", 1, 2, "auto"),        # AutoAWQ int4: shards cut out of the packed tensors
])
def test_split_gives_the_single_process_tokens(model_dirs, awq_checkpoint, expected, name, tp, pp, allreduce):
    import torch

    path = awq_checkpoint if name == "awq" else model_dirs[name][0]
    threads = torch.get_num_threads()
    llm = make_llm(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, cpu_allreduce=allreduce, **ENGINE)
    try:
        assert run(llm) == expected[name]
        stats = llm.llm_engine.get_stats()
        assert stats.comm_ops > 0 and stats.comm_bytes > 0 and stats.comm_seconds > 0
    finally:
        close(llm)
    assert torch.get_num_threads() == threads  # rank 0 gave the caller's process its threads back


def test_more_ranks_than_kv_heads_replicates_them(model_dirs, expected):
    llm = make_llm(model_dirs["llama"][0], tensor_parallel_size=4, **ENGINE)  # 2 KV heads over 4 ranks
    try:
        assert run(llm) == expected["llama"]
    finally:
        close(llm)


def test_int8_weights_quantized_at_load_split_as_one_process_has_them(model_dirs):
    """quantization="int8": a row-parallel rank (o_proj, down_proj) scaled each row by its own columns' max, not
    the whole row's, so its codes differed from a single process's (logprobs apart by 1e-2, tokens diverging).
    Now the ranks agree on each row's max: the same codes, the single process's tokens and logprobs."""
    path = model_dirs["llama"][0]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in DISTINCT]

    def outputs(llm):
        try:
            outs = llm.generate(prompts, sp, use_tqdm=False)
        finally:
            close(llm)
        lps = [[next(iter(r.values())).logprob for r in o.prompt_logprobs[1:]] +
               [next(iter(r.values())).logprob for r in o.outputs[0].logprobs] for o in outs]
        return [o.outputs[0].token_ids for o in outs], lps

    want_tokens, want_lps = outputs(make_llm(path, quantization="int8", **ENGINE))
    tokens, lps = outputs(make_llm(path, quantization="int8", tensor_parallel_size=2, **ENGINE))
    assert tokens == want_tokens
    assert max(abs(a - b) for x, y in zip(lps, want_lps) for a, b in zip(x, y)) < 1e-4


# penalties strong enough that a rank counting a stale placeholder instead of a token picks that token again
PENALIZED = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=3.0, presence_penalty=2.0, ignore_eos=True)


def test_async_scheduling_with_tensor_parallelism_gives_the_single_process_tokens(model_dirs, expected):
    """Every rank leaves its step's tokens on its device and collects them after the next step: a worker that did
    not would count placeholder tokens in its penalties (and its grammar) and sample apart from rank 0."""
    path = model_dirs["llama"][0]
    prompts = [{"prompt_token_ids": p} for p in DISTINCT[:3]]
    plain = make_llm(path, **ENGINE)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, PENALIZED, use_tqdm=False)]
    close(plain)
    llm = make_llm(path, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    try:
        assert llm.llm_engine.core.config.async_scheduling
        assert run(llm) == expected["llama"]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, PENALIZED, use_tqdm=False)] == want
        assert llm.llm_engine.core.scheduler.num_run_ahead > 0
    finally:
        close(llm)


@pytest.mark.parametrize("debug", [True, False])
def test_other_ranks_compile_a_grammar_before_its_first_step(model_dirs, capfd, debug):
    """The engine compiles a structured request's grammar on a thread before the request is scheduled; the
    worker ranks that sample are told to do the same when it arrives, instead of compiling in its first step.
    The workers log at the engine's effective level (a logger left unset gave them level 0: DEBUG lines)."""
    import logging

    log = logging.getLogger("tokenmill")
    level = log.level
    log.setLevel(logging.DEBUG if debug else logging.NOTSET)  # the workers take the engine's level
    try:
        llm = make_llm(model_dirs["llama"][0], tensor_parallel_size=2, **ENGINE)
    finally:
        log.setLevel(level)
    try:
        llm.generate([{"prompt_token_ids": DISTINCT[0]}], REGEX, use_tqdm=False)
        assert ("rank 1: grammar compiled ahead of its request's steps" in capfd.readouterr().err) == debug
    finally:
        close(llm)


def _worker_pids(llm) -> list[int]:
    return [p.pid for _, p in llm.llm_engine.core.executor.procs]


def test_a_killed_worker_ends_the_engine_with_an_error(model_dirs):
    import torch

    threads = torch.get_num_threads()
    llm = make_llm(model_dirs["llama"][0], tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.core.executor
    victim = executor.procs[1][1]
    os.kill(victim.pid, signal.SIGKILL)
    deadline = time.time() + 10
    while executor.failure is None and time.time() < deadline:  # noticed while idle, by the watchdog
        time.sleep(0.05)
    assert executor.failure is not None and f"rank {executor.procs[1][0]}" in executor.failure
    t0 = time.time()
    with pytest.raises(WorkerFailure, match="rank"):
        llm.generate([{"prompt_token_ids": DISTINCT[0]}], GREEDY, use_tqdm=False)
    assert time.time() - t0 < 15
    for _, p in executor.procs:  # every other rank is stopped too
        assert p.wait(timeout=10) is not None
    assert torch.get_num_threads() == threads


def test_a_worker_killed_mid_step_fails_the_step(model_dirs):
    llm = make_llm(model_dirs["llama"][0], tensor_parallel_size=2, **ENGINE)
    executor = llm.llm_engine.core.executor
    pid = executor.procs[0][1].pid
    long_run = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time, signal; time.sleep(1.5); "
                                                     f"os.kill({pid}, signal.SIGKILL)"])
    t0 = time.time()
    # (the reset connection may report before the exit code is known: the message still names both)
    with pytest.raises(WorkerFailure, match=r"worker rank 1 exited with code -9"):
        while time.time() - t0 < 60:  # keep stepping until the kill lands
            llm.generate([{"prompt_token_ids": p} for p in DISTINCT], long_run, use_tqdm=False)
    killer.wait()
    assert time.time() - t0 < 30


def test_a_hung_pipeline_stage_fails_the_engine_after_the_timeout(model_dirs):
    """A last stage that neither answers nor exits (SIGSTOP: a hang) fails the step after distributed_timeout_s,
    as a collective would; the driver waited for its result forever."""
    llm = make_llm(model_dirs["llama"][0], pipeline_parallel_size=2, distributed_timeout_s=3, **ENGINE)
    victim = llm.llm_engine.core.executor.procs[0][1]
    os.kill(victim.pid, signal.SIGSTOP)
    try:
        t0 = time.time()
        with pytest.raises(WorkerFailure, match="no result from the last pipeline stage"):
            llm.generate([{"prompt_token_ids": DISTINCT[0]}], GREEDY, use_tqdm=False)
        assert time.time() - t0 < 20
    finally:
        if victim.poll() is None:  # the engine's failure kills its workers; in case it did not
            os.kill(victim.pid, signal.SIGKILL)
        assert victim.wait(timeout=10) is not None


def test_a_refused_second_engine_leaves_the_first_running(model_dirs):
    """A second multi-rank engine in one process is refused before it starts anything (its cleanup tore down
    the first engine's process group, failing the first engine's next step)."""
    first = make_llm(model_dirs["llama"][0], pipeline_parallel_size=2, **ENGINE)
    want = first.generate([{"prompt_token_ids": DISTINCT[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(RuntimeError, match="already runs a multi-rank engine"):
        make_llm(model_dirs["llama"][0], tensor_parallel_size=2, **ENGINE)
    got = first.generate([{"prompt_token_ids": DISTINCT[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    close(first)


@pytest.mark.parametrize("kw,message", [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(pipeline_parallel_size=3), "larger than the model's 2 layers"),
    (dict(tensor_parallel_size=2, kv_host_cache_gb=0.1), "KV tiers"),
    (dict(tensor_parallel_size=2, nnodes=3), "does not divide the 2 ranks"),
])
def test_sizes_the_model_cannot_split_over_are_refused(model_dirs, kw, message):
    with pytest.raises(ValueError, match=message):
        make_llm(model_dirs["llama"][0], allow_cpu_oversubscription=True, **kw)


def test_vocabulary_that_does_not_split_is_refused(model_dirs, tmp_path):
    import json
    import shutil

    src = model_dirs["llama"][0]
    shutil.copytree(src, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["vocab_size"] = 511
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not divide the vocabulary of 511"):
        make_llm(str(tmp_path / "m"), tensor_parallel_size=2, load_format="dummy")


def test_more_cpu_ranks_than_cores_is_refused(model_dirs, monkeypatch):
    import tokenmill.distributed.layout as layout

    monkeypatch.setattr(layout.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="2 CPU ranks on this node but only 1 cores"):
        make_llm(model_dirs["llama"][0], tensor_parallel_size=2)


def test_a_rendezvous_that_never_completes_times_out(model_dirs):
    from tokenmill.distributed.rendezvous import free_port

    t0 = time.time()
    with pytest.raises(TimeoutError, match="rendezvous timed out.*0 of 1 worker ranks"):
        make_llm(model_dirs["llama"][0], tensor_parallel_size=2, nnodes=2, master_port=free_port("127.0.0.1"),
                 distributed_timeout_s=3)  # node 1 never comes
    assert time.time() - t0 < 30


def test_mismatched_versions_between_nodes_are_refused():
    from tokenmill.distributed.control import check_versions

    ours = {"tokenmill": "0.1.0", "torch": "2.13.0", "python": "3.11.9"}
    check_versions(ours, dict(ours), rank=1)
    with pytest.raises(ValueError, match="rank 3 runs different versions than rank 0: torch 2.13.0 here, 2.12.0 there"):
        check_versions(ours, {**ours, "torch": "2.12.0"}, rank=3)


def test_two_nodes_on_one_machine(model_dirs, expected):
    """Node 1 is a separate `tokenmill serve --node-rank 1` agent, as on a second machine."""
    from tokenmill.distributed.rendezvous import free_port

    path, port = model_dirs["llama"][0], free_port("127.0.0.1")
    common = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
              "--master-port", str(port), "--dtype", "float32", "--max-model-len", "64",
              "--max-num-batched-tokens", "16", "--num-kv-blocks", "10", "--allow-cpu-oversubscription"]
    agent = subprocess.Popen([sys.executable, "-m", "tokenmill", "serve", path, "--node-rank", "1", *common])
    try:
        llm = make_llm(path, tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=0,
                       master_port=port, **ENGINE)
        assert run(llm) == expected["llama"]
        close(llm)
        assert agent.wait(timeout=30) == 0  # its ranks exit with the driver
    finally:
        if agent.poll() is None:
            agent.kill()


def _state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().split()[2]
    except OSError:
        return "gone"


def test_server_with_tensor_parallelism_answers_and_exits_when_a_worker_dies(tiny_model_dir, tmp_path):
    import openai

    ref = make_llm(tiny_model_dir, kv_cache_memory_gb=0.05).generate(
        ["To be, or not"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    server = ServerProcess(tiny_model_dir, tmp_path / "serve.log", "--tensor-parallel-size", "2",
                           "--allow-cpu-oversubscription")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        out = client.completions.create(model="tiny", prompt="To be, or not", max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == ref[0].outputs[0].text
        core = core_pid(server)
        workers = [int(p) for p in open(f"/proc/{core}/task/{core}/children").read().split()]
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        assert server.proc.wait(timeout=30) != 0, server.logs()  # the server exits, with the reason logged
        assert "worker rank 1" in server.logs()
        deadline = time.time() + 20  # the engine core finishes its own exit (it may lag the API process)
        while time.time() < deadline and os.path.exists(f"/proc/{core}") and _state(core) != "Z":
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{core}") or _state(core) == "Z"
    finally:
        if server.proc.poll() is None:
            server.terminate()


def test_stopped_engine_processes_exit_when_their_parent_is_killed(tiny_model_dir, tmp_path):
    """A stopped child (SIGSTOP, a debugger) cannot run the thread that watches for its parent's death, so it
    stayed stopped forever, holding its memory. Each child has a process group of its own: when its parent
    dies, the kernel sends the orphaned, stopped group SIGHUP and SIGCONT. Here the API server is killed with
    its engine core and the core's worker both stopped: the core ends, and then the worker."""
    server = ServerProcess(tiny_model_dir, tmp_path / "serve.log", "--tensor-parallel-size", "2",
                           "--allow-cpu-oversubscription")
    stopped = []
    try:
        server.wait_ready()
        core = core_pid(server)
        worker = int(open(f"/proc/{core}/task/{core}/children").read().split()[0])
        stopped = [core, worker]
        assert os.getpgid(core) == core and os.getpgid(worker) == worker  # groups of their own
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.time() + 10
        while time.time() < deadline and {_state(p) for p in stopped} != {"T"}:
            time.sleep(0.05)
        assert {_state(p) for p in stopped} == {"T"}
        server.proc.kill()
        server.proc.wait(timeout=10)
        deadline = time.time() + 20
        while time.time() < deadline and any(_state(p) not in ("gone", "Z") for p in stopped):
            time.sleep(0.1)
        assert [_state(p) in ("gone", "Z") for p in stopped] == [True, True], [_state(p) for p in stopped]
    finally:
        for pid in stopped:
            if _state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)
        if server.proc.poll() is None:
            server.terminate()


@pytest.mark.parametrize("popen_can", [True, False], ids=["popen-group", "python-3.10"])
def test_a_child_gets_a_process_group_of_its_own(tmp_path, monkeypatch, popen_can):
    """Where Popen cannot give the child its own group (Python 3.10 has no `process_group`), the child makes
    one itself: without it a stopped child outlived its dead parent (the test above)."""
    from tokenmill import child_process

    (tmp_path / "group_child.py").write_text(
        "import os, sys\nfrom tokenmill.child_process import read_payload\n"
        "out = read_payload()\n"
        "open(out, 'w').write(f'{os.getpgrp() == os.getpid()} {os.getpgrp() != int(os.environ[\"PARENT_PGRP\"])}')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PARENT_PGRP", str(os.getpgrp()))
    if not popen_can:
        monkeypatch.setattr(child_process, "_OWN_GROUP", {})
    proc = child_process.spawn_child("group_child", str(tmp_path / "out.txt"))
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / "out.txt").read_text() == "True True"


def test_bench_comm_measures_every_op_and_size(tmp_path):
    import json

    out = tmp_path / "comm.json"
    subprocess.run([sys.executable, "-m", "tokenmill", "bench", "comm", "--world-size", "2", "--sizes", "8B..512B",
                    "--iters", "3", "--warmup", "1", "--result-file", str(out)], check=True, timeout=120)
    result = json.loads(out.read_text())
    assert result["backend"] == "gloo" and result["world_size"] == 2
    assert [(r["op"], r["bytes"]) for r in result["rows"]] == [(op, b) for op in ("all_reduce", "all_gather", "send_recv")
                                                               for b in (8, 32, 128, 512)]
    for r in result["rows"]:
        assert r["time_us"] > 0 and r["algbw_GBps"] > 0
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * (0.5 if r["op"] == "all_gather" else 1.0))


def test_torchrun_starts_every_rank_and_rank_0_answers(model_dirs):
    from tokenmill.distributed.rendezvous import free_port

    path = model_dirs["llama"][0]
    cmd = ["generate", "To be", "--model", path, "--json", "--temperature", "0", "--max-tokens", "8", "--ignore-eos",
           "--dtype", "float32", "--max-model-len", "64"]
    single = subprocess.run([sys.executable, "-m", "tokenmill", *cmd], capture_output=True, text=True, timeout=120,
                            check=True).stdout
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                               str(free_port("127.0.0.1")), "-m", "tokenmill", *cmd, "--tensor-parallel-size", "2",
                               "--allow-cpu-oversubscription"], capture_output=True, text=True, timeout=180)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout == single  # rank 0 prints; the other rank only computes


def test_shared_memory_collectives_match_their_definition(tmp_path):
    """Three ranks as threads over one segment: sums and concatenations, bitwise the same on every rank,
    over many ops (both halves of the double buffer), in float32 and bfloat16."""
    import threading

    import torch

    from tokenmill.distributed.shm_comm import ShmGroup

    path, n = str(tmp_path / "seg"), 3
    groups = [ShmGroup(path, 0, n, 4096, timeout_s=10, create=True)]
    groups += [ShmGroup(path, r, n, 4096, timeout_s=10, create=False) for r in range(1, n)]
    inputs = {r: [torch.randn(5, 7, generator=torch.Generator().manual_seed(10 * r + i)).to(dt)
                  for i, dt in enumerate([torch.float32, torch.bfloat16] * 4)] for r in range(n)}
    results = {}

    def rank(r):
        out = []
        for x in inputs[r]:
            out.append(groups[r].all_reduce(x.clone()))
            out.append(groups[r].all_gather(x))
        results[r] = out

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for i in range(len(inputs[0])):
        total = inputs[0][i].clone()
        for r in range(1, n):
            total += inputs[r][i]
        gathered = torch.cat([inputs[r][i] for r in range(n)], dim=-1)
        for r in range(n):
            assert torch.equal(results[r][2 * i], total)
            assert torch.equal(results[r][2 * i + 1], gathered)
    assert not groups[0].fits(torch.empty(2048))  # 8 KiB > the 4 KiB slot: gloo's job


_SMALL_SHM = """
import errno, os, sys, types
import torch.distributed as dist
from tokenmill.distributed import rendezvous
limit, real = int(sys.argv[1]), os.posix_fallocate
def fallocate(fd, offset, n):  # a /dev/shm of `limit` bytes
    if n > limit:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(fd, offset, n)
os.posix_fallocate = fallocate
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
layout = types.SimpleNamespace(rank=0, tp_rank=0, tp_size=2, pp_rank=0, stage_ranks=lambda stage: [0])
shm = rendezvous._shm_group(layout, None, 16 << 20, 10)
print("SLOT", 0 if shm is None else shm.slot_bytes >> 20)
"""


@pytest.mark.parametrize("limit, slot_mib, warning", [(10**9, 16, None), (5 << 20, 1, "slots are 1 MiB"),
                                                      (1 << 20, 0, "gloo carries every collective")])
def test_a_small_dev_shm_gets_smaller_slots_or_gloo_not_a_bus_error(limit, slot_mib, warning):
    """The segment was a sparse file: its pages came on first write, and a long prompt's all-reduce past a full
    /dev/shm (Docker's default is 64 MiB) killed the rank with SIGBUS, and the server with it. Its pages are
    reserved at startup now; where they do not fit, the slots halve (to 1 MiB), and below that gloo carries
    every collective, with a warning naming the fix."""
    from tokenmill.distributed.rendezvous import free_port

    res = subprocess.run([sys.executable, "-c", _SMALL_SHM, str(limit), str(free_port("127.0.0.1"))],
                         capture_output=True, text=True, timeout=120)
    assert f"SLOT {slot_mib}" in res.stdout, res.stderr[-2000:]
    assert (warning in res.stderr) if warning else "/dev/shm" not in res.stderr
    assert "--shm-size" in res.stderr or warning is None


def test_shared_memory_collective_with_a_silent_peer_times_out_or_cancels(tmp_path):
    import torch

    from tokenmill.distributed.shm_comm import ShmGroup

    g = ShmGroup(str(tmp_path / "seg"), 0, 2, 1024, timeout_s=0.5, create=True)
    with pytest.raises(TimeoutError, match="did not reach"):
        g.all_reduce(torch.ones(4))
    g.cancelled = True
    with pytest.raises(RuntimeError, match="cancelled"):
        g.all_reduce(torch.ones(4))


def test_ray_executor_gives_the_single_process_tokens(model_dirs, expected):
    """distributed_executor_backend='ray': rank 1 is a Ray actor on a local cluster, over the same control
    channel and gloo group."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        llm = make_llm(model_dirs["llama"][0], tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        try:
            assert run(llm) == expected["llama"]
        finally:
            close(llm)
    finally:
        ray.shutdown()


def test_a_reset_connection_waits_a_moment_for_the_workers_exit_code():
    """A killed worker's connection can report (reset, EOF) before its exit code is known: the failure must still
    name the worker and its code, not the reset."""
    from multiprocessing import Pipe

    from tokenmill.distributed.executor import MultiprocExecutor

    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    mine, theirs = Pipe()
    theirs.close()  # the worker's end is gone: ready, with EOF
    proc = subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(0.3); os._exit(3)"])
    try:
        ex.conns, ex.procs, ex._exit_codes = {1: mine}, [(1, proc)], {}
        assert ex._worker_reason(wait_s=5.0) == "worker rank 1 exited with code 3"
    finally:
        proc.wait()
