"""`tokenmill tune --model M --slo ttft_p99=500ms,tpot_p99=50ms [workload flags] [engine flags]`."""
from __future__ import annotations

import json
import math
import sys


def add_tune_parser(sub) -> None:
    from tokenmill.bench.datasets import add_dataset_args
    from tokenmill.engine.arg_utils import add_engine_args
    from tokenmill.tune.space import SPACE

    t = sub.add_parser("tune", help="find the engine settings with the most goodput that meet latency SLOs",
                       description="Each trial is a real `tokenmill serve` process under the workload. Engine "
                                   "flags given here fix those settings; the others are searched.")
    t.add_argument("--slo", required=True, help="targets, e.g. ttft_p99=500ms,tpot_p99=50ms (ttft, tpot, itl, e2el)")
    t.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf: all at once")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    t.add_argument("--max-trials", type=int, default=20)
    t.add_argument("--budget-minutes", type=float, default=None, help="stop starting trials after this long")
    t.add_argument("--output-dir", default="tune-results")
    t.add_argument("--search", default=None, help=f"settings to search (default all): {','.join(SPACE)}")
    t.add_argument("--no-remeasure", action="store_true", help="skip re-measuring the winner against the defaults")
    t.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(t, seed=False)
    add_engine_args(t)
    t.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    from tokenmill.bench.checks import check_writable
    from tokenmill.bench.datasets import (
        dataset_from_args,
        get_tokenizer,
        sample_requests,
    )
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.models.loader import load_hf_config
    from tokenmill.tune.report import serve_command, write_outputs
    from tokenmill.tune.search import best_trial, closest_trial, search
    from tokenmill.tune.slo import misses, parse_slos, per_request_slos, violation
    from tokenmill.tune.space import constraints, fixed_settings, searched, to_flags
    from tokenmill.tune.trial import Workload, run_trial

    slos = parse_slos(args.slo)
    kwargs = engine_kwargs(args)
    _check_engine_flags(kwargs)
    fixed = fixed_settings(kwargs)
    fixed.pop("model", None)
    limits = constraints(load_hf_config(args.model), _ranks_available(kwargs))
    space = searched(args.search.split(",") if args.search else None, fixed, limits)
    if args.max_trials < 1:
        raise ValueError("--max-trials must be >= 1")
    check_writable(args.output_dir, "--output-dir", directory=True)  # not after every trial has run
    tokenizer = get_tokenizer(args.model)
    reqs = sample_requests(dataset_from_args(args), args.num_prompts, tokenizer, args.seed)
    pcts = tuple(sorted({50.0, 90.0, 99.0, *(s.percentile for s in slos)}))
    load = Workload(reqs, args.request_rate, args.max_concurrency, per_request_slos(slos), pcts, seed=args.seed)
    base = ["--model", args.model, *to_flags(fixed)]
    trials = search(space, base, load, slos, args.max_trials, args.budget_minutes, seed=args.seed,
                    show_progress=not args.disable_tqdm, max_ranks=limits["max_ranks"])
    best = best_trial(trials)
    doc = {"slos": [str(s) for s in slos], "fixed": fixed, "space": space, "trials": trials,
           "best": best, "best_command": serve_command(args.model, to_flags(fixed), best["settings"]) if best else None}
    if best is None:  # name the least-bad configuration and how far it misses
        closest = closest_trial(trials)
        if closest is not None:
            doc["closest"] = closest
            doc["closest_command"] = serve_command(args.model, to_flags(fixed), closest["settings"])
            doc["closest_misses"] = misses(closest["result"], slos)
    if best and not args.no_remeasure:  # the winner and the defaults, side by side, within noise of each other
        runs = {}
        for name, settings in (("best", best["settings"]), ("defaults", {})):
            r = run_trial(settings, base, load)
            runs[name] = {"result": {k: r.get(k) for k in ("request_goodput", "output_throughput",
                                                            *[s.key for s in slos])},
                          "meets_slo": not r.get("failed") and violation(r, slos) <= 0}
        g_best, g_def = runs["best"]["result"]["request_goodput"], runs["defaults"]["result"]["request_goodput"]
        runs["goodput_ratio"] = (g_best / g_def) if g_best and g_def else None
        doc["remeasure"] = runs
    paths = write_outputs(args.output_dir, doc, slos)
    print(json.dumps({"best_command": doc["best_command"], "best_settings": best and best["settings"],
                      "remeasure": doc.get("remeasure"), **paths}, indent=1, default=str))
    if best is None:
        hint = ""
        if doc.get("closest_command"):
            hint = (f"; the closest was trial {doc['closest']['number']} ({', '.join(doc['closest_misses'])}): "
                    f"{doc['closest_command']}")
        print(f"no trial met every SLO{hint}; loosen the targets or the load", file=sys.stderr)
        return 1
    return 0


def _ranks_available(kwargs: dict) -> int:
    """Ranks one node can run for a trial: its GPUs on CUDA, its cores on a CPU (one rank per core)."""
    import torch

    from tokenmill.distributed.layout import usable_cores

    if kwargs.get("device", "auto") != "cpu" and torch.cuda.is_available():
        return torch.cuda.device_count()
    return usable_cores()


def _check_engine_flags(kwargs: dict) -> None:
    """The fixed engine flags, checked once against the model before any trial starts a server (a bad one
    would otherwise fail every trial). Raises ValueError."""
    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.models.loader import load_hf_config

    EngineConfig(**kwargs).resolve(ModelConfig.from_hf(load_hf_config(kwargs["model"])))
