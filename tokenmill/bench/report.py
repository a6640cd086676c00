"""`tokenmill bench report RESULTS... --out DIR`: a Markdown report with PNG plots.

Inputs are result files from `bench serve` / `bench offline` (vLLM `--save-detailed` files work too) and
ladder files. Plots: latency CDFs (from the per-request samples), throughput against request rate (files
sharing a label at several rates form one line), results side by side, and the ladder as bars.

Ladder JSON schema (version 1) — one workload through a sequence of engine configurations:

    {
      "kind": "tokenmill-ladder", "version": 1,
      "model": str, "device": str, "date": str, "workload": {...},      # free-form context
      "rungs": [                                                        # in order; each adds one change
        {
          "name": str,                 # short, e.g. "static batching", "+ fused attention"
          "changes": str,              # what this rung changed relative to the one before
          "config": {...},             # engine kwargs (optional)
          "p50_ttft_ms": float, "p99_ttft_ms": float,
          "p50_tpot_ms": float, "p99_tpot_ms": float,
          "output_throughput": float,  # output tokens/s
          "request_throughput": float, # requests/s (optional)
          "peak_memory_mb": float,     # peak RSS on CPU, peak allocated on GPU
          "utilization_pct": float,    # CPU: process CPU time / wall / cores; GPU: NVML mean
          "utilization_kind": "cpu" | "gpu",
          "result_file": str           # the full bench result behind this rung (optional)
        }, ...
      ]
    }

`ladder_rung(name, changes, result)` builds a rung from a `run_offline` result dict.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from tokenmill.bench.checks import read_json

LADDER_KIND = "tokenmill-ladder"
RUNG_FIELDS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput",
               "peak_memory_mb", "utilization_pct")


def ladder_rung(name: str, changes: str, result: dict, config: dict | None = None,
                result_file: str | None = None) -> dict:
    """One ladder rung from a bench result (offline or serve)."""
    gpu = result.get("peak_gpu_memory_mb") is not None
    util = result.get("gpu_utilization") if gpu else result.get("cpu_utilization")
    return {
        "name": name, "changes": changes, "config": config or result.get("engine_kwargs") or {},
        "p50_ttft_ms": result.get("p50_ttft_ms", result.get("median_ttft_ms")),
        "p99_ttft_ms": result.get("p99_ttft_ms"),
        "p50_tpot_ms": result.get("p50_tpot_ms", result.get("median_tpot_ms")),
        "p99_tpot_ms": result.get("p99_tpot_ms"),
        "output_throughput": result.get("output_throughput"),
        "request_throughput": result.get("request_throughput"),
        "peak_memory_mb": result.get("peak_gpu_memory_mb") if gpu else result.get("peak_rss_mb"),
        "utilization_pct": util,
        "utilization_kind": "gpu" if gpu else "cpu",
        "result_file": result_file,
        **{k: result[k] for k in ("by_length_class", "long_short_p99_ttft_ratio", "long_short_p99_e2el_ratio",
                                  "kv_cache", "spec_decode") if result.get(k) is not None},
    }


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _not_numbers(d: dict, keys) -> list[str]:
    """Those of `keys` that `d` has with a value other than a number or null."""
    return [k for k in keys if d.get(k) is not None and not _num(d[k])]


def validate_ladder(d: dict) -> None:
    if d.get("kind") != LADDER_KIND or not isinstance(d.get("rungs"), list) or not d["rungs"]:
        raise ValueError(f"not a ladder file: needs kind={LADDER_KIND!r} and a non-empty 'rungs' list")
    for i, r in enumerate(d["rungs"]):
        if not isinstance(r, dict):
            raise ValueError(f"ladder rung {i} is a {type(r).__name__}, not an object")
        missing = [k for k in ("name", *RUNG_FIELDS) if k not in r]
        if missing:
            raise ValueError(f"ladder rung {i} ({r.get('name', '?')}) lacks {missing}")
        classes = r.get("by_length_class") or {}
        bad = _not_numbers(r, (*RUNG_FIELDS, "long_short_p99_ttft_ratio", "long_short_p99_e2el_ratio"))
        if not isinstance(classes, dict) or not all(isinstance(c, dict) for c in classes.values()):
            bad.append("by_length_class")
        else:
            bad += [f"by_length_class.{c}.{k}" for c, row in classes.items()
                    for k in _not_numbers(row, ("median_ttft_ms", "p99_ttft_ms", "median_e2el_ms", "p99_e2el_ms"))]
        if not isinstance(r.get("utilization_kind", ""), str) or not isinstance(r.get("kv_cache") or {}, dict):
            bad.append("utilization_kind / kv_cache")
        if bad:
            raise ValueError(f"ladder rung {i} ({r['name']}): {bad} of the wrong type")
    pending = d.get("pending") or []
    if not isinstance(pending, list) or not all(isinstance(x, dict) and "name" in x for x in pending):
        raise ValueError("the ladder's 'pending' must be a list of {\"name\": ..., \"why\": ...}")


# what the report reads of a bench result: needed numbers, then numbers (or null) where present
RESULT_NUMBERS = ("completed", "request_throughput", "output_throughput")
RESULT_OPTIONAL_NUMBERS = ("failed", "max_concurrency", "request_goodput", "median_ttft_ms", "p99_ttft_ms",
                           "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms", "peak_rss_mb",
                           "cpu_utilization")


def validate_result(d: dict) -> None:
    bad = [k for k in RESULT_NUMBERS if not _num(d.get(k))] + _not_numbers(d, RESULT_OPTIONAL_NUMBERS)
    bad += [k for k in ("label", "backend") if d.get(k) is not None and not isinstance(d[k], str)]
    try:
        _rate(d)
    except (TypeError, ValueError):
        bad.append("request_rate")
    if bad:
        raise ValueError(f"not a usable bench result: {bad} missing or of the wrong type")
    _samples(d)


# -- loading ---------------------------------------------------------------------------------------------------
def _rate(d: dict) -> float:
    r = d.get("request_rate", "inf")
    return math.inf if r in ("inf", None) else float(r)


def load_inputs(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(results, ladders); each dict gains '_path' and results a unique '_name'."""
    results, ladders = [], []
    for p in paths:
        d = read_json(p, dict, "not a JSON file",
                      "neither a bench result nor a ladder file (a JSON {type}, not an object)")
        d["_path"] = str(p)
        try:
            if d.get("kind") == LADDER_KIND or "rungs" in d:
                validate_ladder(d)
                ladders.append(d)
            elif "completed" in d and "request_throughput" in d:
                validate_result(d)
                results.append(d)
            else:
                raise ValueError("neither a bench result nor a ladder file")
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
    labels = [r.get("label") or r.get("backend") or Path(r["_path"]).stem for r in results]
    for r, lab in zip(results, labels):
        dup = labels.count(lab) > 1
        r["_name"] = f"{lab} @ {_fmt_rate(_rate(r))} req/s" if dup else lab
    names = [r["_name"] for r in results]
    for r in results:  # still ambiguous (same label and rate): fall back to the file name
        if names.count(r["_name"]) > 1:
            r["_name"] = f"{r['_name']} ({Path(r['_path']).stem})"
    return results, ladders


def _fmt_rate(r: float) -> str:
    return "inf" if math.isinf(r) else f"{r:g}"


def _samples(d: dict) -> dict[str, list[float]] | None:
    """Per-request samples in ms, as the metric definitions compute them (successful requests only)."""
    if "latencies" not in d:
        return None
    n = len(d["latencies"]) if isinstance(d["latencies"], list) else -1
    ok = d.get("successes") or [not e for e in d.get("errors", [""] * max(n, 0))]
    uneven = [k for k in ("latencies", "ttfts", "output_lens", "itls")
              if not isinstance(d.get(k), list) or len(d[k]) != n]
    if uneven or not isinstance(ok, list) or len(ok) != n:
        raise ValueError(f"per-request samples {uneven or ['successes / errors']} are not lists as long as "
                         "'latencies'")
    s = {"ttft": [], "tpot": [], "itl": [], "e2el": []}
    for i in range(n):
        if not ok[i]:
            continue
        ttft, lat, k = d["ttfts"][i], d["latencies"][i], d["output_lens"][i]
        if not (_num(ttft) and _num(lat) and _num(k) and isinstance(d["itls"][i], list)
                and all(map(_num, d["itls"][i]))):
            raise ValueError(f"request {i}'s samples (ttfts, latencies, output_lens, itls) are not numbers")
        s["ttft"].append(ttft * 1000)
        s["e2el"].append(lat * 1000)
        s["itl"] += [g * 1000 for g in d["itls"][i]]
        if k > 1:
            s["tpot"].append((lat - ttft) / (k - 1) * 1000)
    return s


# -- plots -----------------------------------------------------------------------------------------------------
def _plt():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def plot_cdfs(results: list[dict], out: Path) -> str | None:
    have = [(r["_name"], s) for r in results if (s := _samples(r))]
    if not have:
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (m, title) in zip(axes.flat, [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")]):
        for name, s in have:
            v = np.sort(np.asarray(s[m]))
            if len(v):
                ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=name)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        for q in (0.5, 0.99):
            ax.axhline(q, color="grey", lw=0.6, ls=":")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)
    plt.close(fig)
    return "latency_cdf.png"


def plot_rate_sweep(results: list[dict], out: Path) -> str | None:
    series: dict[str, list[dict]] = {}
    for r in results:
        series.setdefault(r.get("label") or r.get("backend") or "run", []).append(r)
    series = {k: v for k, v in series.items() if len({_rate(r) for r in v}) >= 2}
    if not series:
        return None
    finite = [_rate(r) for v in series.values() for r in v if not math.isinf(_rate(r))]
    inf_x = (max(finite) * 1.5) if finite else 1.0  # where "inf" sits on the x axis
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, runs in series.items():
        runs = sorted(runs, key=_rate)
        xs = [inf_x if math.isinf(_rate(r)) else _rate(r) for r in runs]
        axes[0].plot(xs, [r["output_throughput"] for r in runs], "o-", label=name)
        # (a run without p99 (--metric-percentiles 50,90) leaves a gap: its median, plotted here, was titled P99)
        axes[1].plot(xs, [r.get("p99_ttft_ms", math.nan) for r in runs], "o-", label=name)
        axes[2].plot(xs, [r.get("p99_tpot_ms", math.nan) for r in runs], "o-", label=name)
    for ax, t in zip(axes, ["output tokens/s", "P99 TTFT (ms)", "P99 TPOT (ms)"]):
        ax.set_xlabel("request rate (req/s); rightmost = inf" if any(
            math.isinf(_rate(r)) for v in series.values() for r in v) else "request rate (req/s)")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_rate.png", dpi=110)
    plt.close(fig)
    return "throughput_vs_rate.png"


def _bars(ax, names: list[str], values: list, title: str) -> None:
    # a figure a run does not have (no p99, no E2EL in a vLLM file) is no bar and "n/a", not a bar of 0
    known = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in values]
    vals = [v if k else 0.0 for v, k in zip(values, known)]
    bars = ax.bar(range(len(names)), vals, color=[f"C{i % 10}" for i in range(len(names))])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    for b, v, k in zip(bars, values, known):
        ax.annotate(f"{v:.3g}" if k else "n/a", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=7)


def plot_side_by_side(results: list[dict], out: Path) -> str | None:
    if len(results) < 2:
        return None
    plt = _plt()
    names = [r["_name"] for r in results]
    panels = [("output_throughput", "output tokens/s"), ("request_throughput", "requests/s"),
              ("p99_ttft_ms", "P99 TTFT (ms)"), ("p99_tpot_ms", "P99 TPOT (ms)"),
              ("p99_itl_ms", "P99 ITL (ms)"), ("p99_e2el_ms", "P99 E2EL (ms)")]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (k, t) in zip(axes.flat, panels):
        _bars(ax, names, [r.get(k) for r in results], t)
    fig.tight_layout()
    fig.savefig(out / "side_by_side.png", dpi=110)
    plt.close(fig)
    return "side_by_side.png"


def plot_ladder(ladder: dict, out: Path, stem: str) -> str:
    plt = _plt()
    rungs = ladder["rungs"]
    names = [r["name"] for r in rungs]
    kind = rungs[-1].get("utilization_kind", "cpu").upper()
    panels = [(("p50_ttft_ms", "p99_ttft_ms"), "TTFT (ms): P50 / P99"),
              (("p50_tpot_ms", "p99_tpot_ms"), "TPOT (ms): P50 / P99"),
              (("output_throughput",), "output tokens/s"),
              (("peak_memory_mb",), "peak memory (MiB)"),
              (("utilization_pct",), f"{kind} utilization (%)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.5))
    x = np.arange(len(rungs))
    for ax, (keys, title) in zip(axes, panels):
        w = 0.8 / len(keys)
        for j, k in enumerate(keys):
            vals = [r.get(k) or 0.0 for r in rungs]
            grouped = len(keys) > 1
            label = k.split("_")[0].upper() if grouped else None
            ax.bar(x + (j - (len(keys) - 1) / 2) * w, vals, w, label=label,
                   color=f"C{j}" if grouped else [f"C{i % 10}" for i in range(len(rungs))])
        _rung_axis(ax, names, title, legend=len(keys) > 1)
    fig.suptitle(f"ladder: {ladder.get('model', '')} {ladder.get('device', '')}".strip())
    return _save(plt, fig, out / f"ladder_{stem}.png")


def _rung_axis(ax, names: list[str], title: str, legend: bool) -> None:
    ax.set_xticks(np.arange(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    if legend:
        ax.legend(fontsize=7)


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# -- markdown --------------------------------------------------------------------------------------------------
def _f(v, digits: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _results_table(results: list[dict]) -> list[str]:
    cols = [("run", lambda r: r["_name"]), ("kind", lambda r: r.get("kind", "serve")),
            ("rate", lambda r: _fmt_rate(_rate(r))), ("conc.", lambda r: _f(r.get("max_concurrency"))),
            ("ok/failed", lambda r: f"{r['completed']}/{_f(r.get('failed'))}"),
            ("req/s", lambda r: _f(r["request_throughput"], 2)), ("out tok/s", lambda r: _f(r["output_throughput"])),
            ("goodput req/s", lambda r: _f(r.get("request_goodput"), 2)),
            ("TTFT p50/p99 ms", lambda r: f"{_f(r.get('median_ttft_ms'))} / {_f(r.get('p99_ttft_ms'))}"),
            ("TPOT p50/p99 ms", lambda r: f"{_f(r.get('median_tpot_ms'))} / {_f(r.get('p99_tpot_ms'))}"),
            ("ITL p99 ms", lambda r: _f(r.get("p99_itl_ms"))), ("E2EL p99 ms", lambda r: _f(r.get("p99_e2el_ms"))),
            ("peak RSS MiB", lambda r: _f(r.get("peak_rss_mb"), 0)), ("CPU %", lambda r: _f(r.get("cpu_utilization")))]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(fn(r)) for _, fn in cols) + " |" for r in results]
    return lines


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "–"


def _ladder_table(ladder: dict) -> list[str]:
    lines = ["| rung | changes | TTFT p50/p99 ms | TPOT p50/p99 ms | out tok/s | vs previous | peak MiB | util % |",
             "|---|---|---|---|---|---|---|---|"]
    prev = None
    for r in ladder["rungs"]:
        vs = "–" if prev is None else (f"throughput {_ratio(r['output_throughput'], prev['output_throughput'])}, "
                                       f"P99 TTFT {_ratio(r['p99_ttft_ms'], prev['p99_ttft_ms'])}")
        lines.append(f"| {r['name']} | {r.get('changes', '')} | {_f(r['p50_ttft_ms'])} / {_f(r['p99_ttft_ms'])} | "
                     f"{_f(r['p50_tpot_ms'])} / {_f(r['p99_tpot_ms'])} | {_f(r['output_throughput'])} | {vs} | "
                     f"{_f(r['peak_memory_mb'], 0)} | {_f(r['utilization_pct'])} "
                     f"({r.get('utilization_kind', 'cpu')}) |")
        prev = r
    return lines


def _class_table(ladder: dict) -> list[str]:
    """Per length class (long-text ladders): P50/P99 TTFT and E2E, and the long/short P99 ratios."""
    rungs = [r for r in ladder["rungs"] if r.get("by_length_class")]
    if not rungs:
        return []
    classes = sorted({c for r in rungs for c in r["by_length_class"]})
    head = "| rung | " + " | ".join(f"{c}: TTFT p50/p99 ms | {c}: E2E p50/p99 ms" for c in classes)
    lines = [head + " | long/short P99 TTFT | long/short P99 E2E | prefix hit % |",
             "|---|" + "---|---|" * len(classes) + "---|---|---|"]
    for r in rungs:
        cells = []
        for c in classes:
            row = r["by_length_class"].get(c, {})
            cells += [f"{_f(row.get('median_ttft_ms'))} / {_f(row.get('p99_ttft_ms'))}",
                      f"{_f(row.get('median_e2el_ms'))} / {_f(row.get('p99_e2el_ms'))}"]
        hit = (r.get("kv_cache") or {}).get("prefix_cache_hit_rate")
        lines.append(f"| {r['name']} | " + " | ".join(cells) +
                     f" | {_f(r.get('long_short_p99_ttft_ratio'), 2)}x | {_f(r.get('long_short_p99_e2el_ratio'), 2)}x"
                     f" | {_f(None if hit is None else 100 * hit)} |")
    return lines


def plot_class_ladder(ladder: dict, out: Path, stem: str) -> str | None:
    """P99 TTFT per length class on a log axis, and the long/short ratio against the 2x goal."""
    rungs = [r for r in ladder["rungs"] if r.get("by_length_class")]
    if not rungs:
        return None
    plt = _plt()
    names = [r["name"] for r in rungs]
    classes = sorted({c for r in rungs for c in r["by_length_class"]})
    x = np.arange(len(rungs))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    w = 0.8 / len(classes)
    for j, cls in enumerate(classes):
        for ax, key in ((a, "p99_ttft_ms"), (b, "p99_e2el_ms")):
            vals = [r["by_length_class"].get(cls, {}).get(key) or 0.0 for r in rungs]
            ax.bar(x + (j - (len(classes) - 1) / 2) * w, vals, w, label=cls, color=f"C{j}")
    ratios = [r.get("long_short_p99_ttft_ratio") or 0.0 for r in rungs]
    c.bar(x, ratios, 0.6, color="C2")
    c.axhline(2.0, color="k", ls="--", lw=1, label="goal 2x")
    for ax, title in ((a, "P99 TTFT (ms) by class"), (b, "P99 E2E latency (ms) by class"),
                      (c, "long / short P99 TTFT")):
        _rung_axis(ax, names, title, legend=True)
    a.set_yscale("log")
    b.set_yscale("log")
    fig.suptitle(f"long-text ladder: {Path(str(ladder.get('model', ''))).name} {ladder.get('device', '')}".strip())
    return _save(plt, fig, out / f"ladder_{stem}_classes.png")


def render_report(paths: list[str], out_dir: str, title: str = "tokenmill benchmark report") -> str:
    """Write report.md and its PNGs into out_dir; return the Markdown path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, ladders = load_inputs(paths)
    md = [f"# {title}", ""]
    if results:
        md += ["## Results", "", *_results_table(results), ""]
        md += ["Files: " + ", ".join(f"`{r['_path']}`" for r in results), ""]
        for heading, fn in (("Side by side", plot_side_by_side), ("Latency CDFs", plot_cdfs),
                            ("Throughput against request rate", plot_rate_sweep)):
            png = fn(results, out)
            if png:
                md += [f"## {heading}", "", f"![{heading}]({png})", ""]
    for i, lad in enumerate(ladders):
        stem = Path(lad["_path"]).stem or str(i)
        md += [f"## Ladder: {Path(str(lad.get('model') or stem)).name}", ""]
        ctx = {k: lad[k] for k in ("device", "date", "workload") if k in lad}
        if ctx:
            md += ["```", json.dumps(ctx, indent=1, default=str), "```", ""]
        md += [*_ladder_table(lad), ""]
        pending = lad.get("pending") or []
        if pending:  # rungs the ladder could not run yet, and why
            md += ["Not yet on the ladder: " + "; ".join(f"**{p['name']}** ({p.get('why', '')})" for p in pending), ""]
        md += [f"![ladder]({plot_ladder(lad, out, stem)})", ""]
        classes = _class_table(lad)
        if classes:
            md += ["### By prompt length class", "", *classes, "", f"![by class]({plot_class_ladder(lad, out, stem)})", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return str(path)
