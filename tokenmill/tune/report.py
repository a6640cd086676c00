"""What `tokenmill tune` writes to --output-dir:

    tune.json        every trial (settings, result, value), the winner, the re-measurement, the SLOs
    best_command.sh  the winner as a `tokenmill serve` command line
    report.md        a table of the trials, the re-measurement, and three plots:
                     goodput per trial, P99 of each SLO metric per trial, the latency/throughput Pareto front
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from tokenmill.tune.slo import SLO
from tokenmill.tune.space import to_flags


def serve_command(model: str, fixed_flags: list[str], settings: dict) -> str:
    return shlex.join(["tokenmill", "serve", "--model", model, *fixed_flags, *to_flags(settings)])


def write_outputs(out_dir: str, doc: dict, slos: list[SLO]) -> dict[str, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": str(out / "tune.json"), "command": str(out / "best_command.sh"), "report": str(out / "report.md")}
    Path(paths["json"]).write_text(json.dumps(doc, indent=1, default=str))
    command = doc.get("best_command") or (f"# no trial met every SLO; the closest:\n{doc['closest_command']}"
                                          if doc.get("closest_command") else "# no trial met every SLO")
    Path(paths["command"]).write_text(command + "\n")
    plots = _plots(out, doc["trials"], slos)
    Path(paths["report"]).write_text(_markdown(doc, slos, plots))
    return paths


def _plots(out: Path, trials: list[dict], slos: list[SLO]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [t for t in trials if not t.get("failed")]
    nums = [t["number"] for t in done]
    names = []
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(nums, [t["result"].get("request_goodput") or 0 for t in done],
           color=["tab:green" if t["meets_slo"] else "tab:gray" for t in done])
    ax.set(xlabel="trial", ylabel="goodput (req/s)", title="Goodput per trial (green: meets every SLO)")
    fig.tight_layout()
    fig.savefig(out / "goodput.png", dpi=110)
    names.append("goodput.png")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for s in slos:
        ax.plot(nums, [t["result"].get(s.key) for t in done], "o-", label=s.key)
        ax.axhline(s.ms, linestyle="--", linewidth=0.8, color=ax.lines[-1].get_color())
    ax.set(xlabel="trial", ylabel="ms", title="SLO metrics per trial (dashed: targets)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "p99.png", dpi=110)
    names.append("p99.png")
    fig, ax = plt.subplots(figsize=(6, 3.2))
    pts = sorted((t["result"].get("output_throughput") or 0, t["result"].get(slos[0].key) or 0) for t in done)
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", s=14)
    front, best = [], float("inf")
    for x, y in sorted(pts, key=lambda p: -p[0]):  # highest throughput first; keep what lowers latency
        if y < best:
            front.append((x, y))
            best = y
    ax.plot([p[0] for p in front], [p[1] for p in front], "r-", label="Pareto front")
    ax.set(xlabel="output tokens/s", ylabel=f"{slos[0].key}", title="Latency / throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=110)
    names.append("pareto.png")
    plt.close("all")
    return names


def _markdown(doc: dict, slos: list[SLO], plots: list[str]) -> str:
    lines = ["# tokenmill tune", "", f"SLOs: {', '.join(map(str, slos))}", "",
             f"Best: `{doc.get('best_command') or 'no trial met every SLO'}`", ""]
    if doc.get("closest_command"):
        lines += [f"Closest (trial {doc['closest']['number']}, misses {'; '.join(doc['closest_misses'])}): "
                  f"`{doc['closest_command']}`", ""]
    rem = doc.get("remeasure")
    if rem:
        lines += ["## Re-measured side by side", "", "| config | goodput (req/s) | meets SLO | " +
                  " | ".join(s.key for s in slos) + " |", "|---|---|---|" + "---|" * len(slos)]
        for name in ("best", "defaults"):
            r = rem[name]
            lines.append(f"| {name} | {r['result'].get('request_goodput') or 0:.3f} | {r['meets_slo']} | " +
                         " | ".join(f"{r['result'].get(s.key) or 0:.1f}" for s in slos) + " |")
        lines += ["", f"Goodput ratio, best / defaults: {rem.get('goodput_ratio')}", ""]
    lines += ["## Trials", "", "| # | settings | goodput | meets SLO | pruned | failed |", "|---|---|---|---|---|---|"]
    for t in doc["trials"]:
        lines.append(f"| {t['number']} | `{json.dumps(t['settings'])}` | {t['result'].get('request_goodput') or 0:.3f} | "
                     f"{t['meets_slo']} | {t['pruned']} | {'yes' if t.get('failed') else ''} |")
    lines += [""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(lines)
