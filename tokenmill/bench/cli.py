"""`tokenmill bench serve | offline | comm | report | ladder`: argparse wiring. Flag names follow `vllm bench serve`."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path

from tokenmill.bench.checks import check_limit_mm, check_writable
from tokenmill.bench.metrics import METRICS, format_table, parse_goodput


def _percentiles(s: str) -> list[float]:
    try:
        ps = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be numbers in (0, 100], e.g. 50,90,99, got {s!r}") from None
    if not ps or not all(0 < p <= 100 for p in ps):  # (nan fails the comparison too)
        raise argparse.ArgumentTypeError(f"must be numbers in (0, 100], e.g. 50,90,99, got {s!r}")
    return ps


def _key_value(s: str) -> str:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {s!r}")
    return s


def _json_object(s: str) -> dict:
    try:
        value = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"seed\": 1}}', got {s!r}")
    return value


def _metrics(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown metric(s) {bad}; choose from {list(METRICS)}")
    return names


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """Arrival, sampling and output flags shared by serve and offline."""
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s; inf (default) sends everything at t=0, else Poisson/gamma arrivals")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more uniform")
    g.add_argument("--num-warmups", type=int, default=None, help="warm-up requests before measuring")
    g.add_argument("--ignore-eos", action="store_true", help="always generate the full output length")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    o = p.add_argument_group("results")
    o.add_argument("--percentile-metrics", type=_metrics, default="ttft,tpot,itl,e2el",
                   help="metrics whose percentiles the console table shows (the JSON has all)")
    o.add_argument("--metric-percentiles", type=_percentiles, default="50,90,99", help="e.g. 50,90,99")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:2000")
    o.add_argument("--result-file", "--result-filename", dest="result_file", default=None,
                   help="write the JSON result here")
    o.add_argument("--label", default=None, help="name of this run in reports")
    o.add_argument("--metadata", nargs="*", type=_key_value, default=None, metavar="KEY=VALUE",
                   help="recorded in the result")
    o.add_argument("--disable-tqdm", action="store_true")


def _sampling(args) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}


def _finish(args, result: dict, title: str) -> int:
    from tokenmill.bench.datasets import dataset_config

    result["label"] = args.label or result.get("backend")
    result["dataset"] = dataset_config(args)
    if args.metadata:
        result["metadata"] = dict(kv.split("=", 1) for kv in args.metadata)
    print(format_table(result, args.percentile_metrics, args.metric_percentiles, title))
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=1)
        print(f"result written to {args.result_file}")
    if not result["completed"]:  # otherwise the cause is only in the JSON
        first = next((e for e in result.get("errors") or [] if e), "")
        if first.startswith("Traceback"):  # a client-side exception: its last line names it
            first = first.strip().splitlines()[-1]
        first = " ".join(first.split())[:300]  # one line
        print(f"error: all {result['num_prompts']} requests failed; the first: {first or '(no error recorded)'}",
              file=sys.stderr)
        return 1
    return 0


def cmd_serve(args) -> int:
    from tokenmill.bench.datasets import dataset_from_args, get_tokenizer, sample_requests
    from tokenmill.bench.serve_client import auth_headers, fetch_first_model, run_benchmark

    if args.tokenizer and not os.path.isdir(args.tokenizer):
        raise ValueError(f"--tokenizer {args.tokenizer}: no such directory (a local tokenizer directory)")
    check_writable(args.result_file, "--result-file")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    model = args.model or asyncio.run(fetch_first_model(base_url, auth_headers(args.api_key)))
    tokenizer = get_tokenizer(args.tokenizer or args.model)
    if tokenizer is None:
        print("note: no local tokenizer (--tokenizer DIR): text prompts, approximate lengths", file=sys.stderr)
    endpoint = args.endpoint or ("chat" if args.backend == "openai-chat" else "completions")
    reqs = sample_requests(dataset_from_args(args), args.num_prompts, tokenizer, args.seed)
    slos = parse_goodput(args.goodput)
    result = asyncio.run(run_benchmark(
        reqs, base_url, args.served_model_name or model, endpoint=endpoint, tokenizer=tokenizer,
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        seed=args.seed, ignore_eos=args.ignore_eos, sampling=_sampling(args),
        extra_body=args.extra_body, api_key=args.api_key,
        num_warmups=args.num_warmups or 0, percentiles=args.metric_percentiles, goodput_slos_ms=slos,
        disable_tqdm=args.disable_tqdm))
    result["tokenizer_id"] = args.tokenizer or (args.model if tokenizer is not None else None)
    return _finish(args, result, "Serving Benchmark Result")


def cmd_offline(args) -> int:
    from tokenmill.bench.datasets import dataset_from_args, sample_requests
    from tokenmill.bench.offline import build_engine, run_offline
    from tokenmill.config import EngineConfig
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.engine.input_processor import config_tokenizer
    from tokenmill.models.loader import load_hf_config

    check_writable(args.result_file, "--result-file")
    check_limit_mm(args)
    kwargs = engine_kwargs(args)
    # the workload first, with the engine's tokenizer alone: a bad dataset file is named before the weights load
    config = EngineConfig(**kwargs)
    load_hf_config(config.model)  # (a bad config.json is named as such: the tokenizer reads it too)
    reqs = sample_requests(dataset_from_args(args), args.num_prompts, config_tokenizer(config), args.seed)
    engine = build_engine(kwargs)
    result = run_offline(reqs, kwargs, engine=engine, request_rate=args.request_rate, burstiness=args.burstiness,
                         seed=args.seed, ignore_eos=args.ignore_eos, sampling=_sampling(args),
                         num_warmups=1 if args.num_warmups is None else args.num_warmups,
                         percentiles=args.metric_percentiles, goodput_slos_ms=parse_goodput(args.goodput),
                         disable_tqdm=args.disable_tqdm)
    return _finish(args, result, "Offline Benchmark Result")


def cmd_comm(args) -> int:
    from tokenmill.bench.comm import cmd_comm as run, resolve_backend

    check_writable(args.result_file, "--result-file")
    resolve_backend(args)
    return run(args)


def cmd_report(args) -> int:
    from tokenmill.bench.report import render_report

    md = render_report(args.results, args.out, title=args.title)
    print(f"report written to {md}")
    return 0


def add_bench_parser(subparsers) -> argparse._SubParsersAction:
    """Add `bench` to the top-level CLI; returns bench's own subparsers so more modes (ladder) can join."""
    from tokenmill.bench.datasets import add_dataset_args

    b = subparsers.add_parser("bench", help="benchmarks: load a server, the offline engine; render reports")
    bsub = b.add_subparsers(dest="bench_command", required=True)

    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server over streaming requests")
    s.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--endpoint", default=None,
                   help="'completions' (default), 'chat', or a path such as /v1/chat/completions")
    s.add_argument("--backend", default="openai", choices=["openai", "openai-chat"], help="vLLM-style alias")
    s.add_argument("--model", default=None, help="model name to request (default: the server's first model); "
                                                   "a local directory also supplies the tokenizer")
    s.add_argument("--served-model-name", default=None, help="name to put in requests, if not --model")
    s.add_argument("--tokenizer", default=None, help="local tokenizer directory (exact prompt lengths)")
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    s.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    s.add_argument("--extra-body", type=_json_object, default=None,
                   help="a JSON object merged into every request body")
    add_dataset_args(s)
    _add_run_args(s)
    s.set_defaults(func=cmd_serve)

    from tokenmill.engine.arg_utils import add_engine_args

    o = bsub.add_parser("offline", help="throughput and latency of the in-process engine")
    add_engine_args(o)  # its --seed also seeds the workload
    add_dataset_args(o, seed=False)
    _add_run_args(o)
    o.set_defaults(func=cmd_offline)

    c = bsub.add_parser("comm", help="all-reduce, all-gather and send/recv latency and bandwidth (nccl-tests style)")
    from tokenmill.bench.comm import add_comm_args

    add_comm_args(c)
    c.set_defaults(func=cmd_comm)

    r = bsub.add_parser("report", help="Markdown report with PNG plots from result (and ladder) JSON files")
    r.add_argument("results", nargs="+", help="result JSON files from bench serve/offline, or ladder JSON")
    r.add_argument("--out", required=True, help="output directory")
    r.add_argument("--title", default="tokenmill benchmark report")
    r.set_defaults(func=cmd_report)

    from tokenmill.bench.ladder import add_ladder_parser

    add_ladder_parser(bsub)
    return bsub


def main(argv=None) -> int:
    """`python -m tokenmill.bench.cli ...` (the same as `tokenmill bench ...`, its one-line errors included)."""
    parser = argparse.ArgumentParser(prog="tokenmill")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
