"""`tokenmill` command line: generate, eval ppl, serve, bench, quantize, tune. `python -m tokenmill` is the same."""
from __future__ import annotations

import argparse
import json
import os
import sys

from tokenmill.engine.arg_utils import add_engine_args, bare_flags_take_const, engine_kwargs
from tokenmill.entrypoints.openai.cli_args import positive_int


# what `generate` samples with where neither a flag nor the model's generation_config.json says
GENERATE_DEFAULTS = dict(max_tokens=64, temperature=0.8, top_p=0.95, top_k=0, min_p=0.0, repetition_penalty=1.0)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """Flags left unset (None) take the model's sampling defaults, then GENERATE_DEFAULTS."""
    for name, default in GENERATE_DEFAULTS.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=None,
                       help=f"(default: the model's generation_config.json, else {default})")
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)


def cmd_generate(args) -> int:
    from tokenmill import LLM, SamplingParams

    given = {k: getattr(args, k) for k in GENERATE_DEFAULTS if getattr(args, k) is not None}
    rest = dict(n=args.n, presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                stop=args.stop, seed=args.sampling_seed, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    SamplingParams(**{**GENERATE_DEFAULTS, **given}, **rest)  # bad flags fail before the model loads
    code = worker_node(args)
    if code is not None:
        return code
    llm = LLM(**engine_kwargs(args))
    model = llm.llm_engine.input_processor.sampling_defaults
    sp = SamplingParams(**{**GENERATE_DEFAULTS, **model, **given}, **rest)
    prompts = args.prompt or ["To be, or not to be"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)
    else:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        for c in out.outputs:
            if args.json:
                print(json.dumps({"prompt": p, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                                  "finish_reason": c.finish_reason}))
            else:
                print(f"--- prompt: {p!r}" + (f" [{c.index}]" if args.n > 1 else ""))
                print(p + c.text if not args.chat else c.text)
                print(f"--- ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    return 0


def cmd_eval_ppl(args) -> int:
    from tokenmill.evaluation.engine_ppl import evaluate_perplexity

    res = evaluate_perplexity(text_path=args.text, window=args.window, **engine_kwargs(args))
    print(json.dumps(res, indent=2))
    return 0


def cmd_serve(args) -> int:
    from tokenmill.entrypoints.openai.api_server import run_server

    code = worker_node(args)
    return code if code is not None else run_server(args) or 0


def worker_node(args) -> int | None:
    """Where this process is not the engine's rank 0 (a multi-node engine's node_rank > 0, or a torchrun
    rank > 0), run its ranks and return their exit code; None for the process that serves."""
    if args.node_rank == 0 and "RANK" not in os.environ:
        return None
    from tokenmill.config import EngineConfig
    from tokenmill.distributed.executor import run_launched_rank, run_node_agent

    config = EngineConfig(**engine_kwargs(args))
    if args.node_rank > 0:
        return run_node_agent(config)
    return run_launched_rank(config)


def cmd_quantize(args) -> int:
    from tokenmill.quantization.awq_calibrate import quantize_model

    _, summary = quantize_model(args.model, args.output, method=args.method, bits=args.bits,
                                group_size=args.group_size, calib_data=args.calib_data,
                                num_samples=args.num_samples, seq_len=args.seq_len, seed=args.seed)
    summary.pop("layers")
    print(json.dumps(summary))
    return 0


def add_quantize_parser(sub) -> None:
    from tokenmill.config import DEFAULT_MODEL

    q = sub.add_parser("quantize", help="AWQ (or round-to-nearest) weight quantization of a float model",
                       description="Writes an AutoAWQ GEMM checkpoint (4-bit) or tokenmill's 8-bit AWQ format; "
                                   "see tokenmill/quantization/awq_calibrate.py for the format.")
    q.add_argument("--model", default=DEFAULT_MODEL, help="float model directory (default: the shipped model)")
    q.add_argument("--output", required=True, help="new (or empty) output directory")
    q.add_argument("--method", choices=["awq", "rtn"], default="awq", help="rtn: round-to-nearest, no calibration")
    q.add_argument("--bits", type=int, default=4, help="4 (AutoAWQ GEMM) or 8 (tokenmill-w8)")
    q.add_argument("--group-size", type=int, default=None,
                   help="4-bit quantization group along K: 32, 64 or 128 (default: 128, or the largest that "
                        "divides every layer's input)")
    q.add_argument("--calib-data", default=None,
                   help="calibration text (.txt, or .jsonl with a \"text\" field); default: the shipped "
                        "sample of the tiny model's training split")
    q.add_argument("--num-samples", type=int, default=128, help="calibration samples")
    q.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sample")
    q.add_argument("--seed", type=int, default=0, help="which calibration windows are drawn")
    q.set_defaults(func=cmd_quantize)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline")
    g.add_argument("prompt", nargs="*", help="prompt(s); default: a Shakespeare line")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="one JSON line per completion")
    add_engine_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="evaluate a model")
    esub = e.add_subparsers(dest="eval_command", required=True)
    ppl = esub.add_parser("ppl", help="perplexity on held-out text")
    ppl.add_argument("--text", default=None, help="text file (default: the shipped Shakespeare validation text)")
    ppl.add_argument("--window", type=positive_int, default=None, help="tokens per window (default: max_model_len)")
    add_engine_args(ppl, dtype="float32")  # scores compare with the model cards' float32 figures
    ppl.set_defaults(func=cmd_eval_ppl)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_tag", nargs="?", default=None, help="model directory (same as --model)")
    add_engine_args(s)
    from tokenmill.entrypoints.openai.cli_args import add_server_args

    add_server_args(s)
    s.set_defaults(func=cmd_serve)

    from tokenmill.bench.cli import add_bench_parser

    add_bench_parser(sub)
    add_quantize_parser(sub)
    from tokenmill.tune.cli import add_tune_parser

    add_tune_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(bare_flags_take_const(sys.argv[1:] if argv is None else list(argv)))
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # (OSError: a file named on the command line that is not there)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
