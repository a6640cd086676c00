"""SLO strings: `metric_pP=VALUE[ms|s]`, comma-separated, e.g. `ttft_p99=500ms,tpot_p99=50ms`."""
from __future__ import annotations

import re
from dataclasses import dataclass

METRICS = ("ttft", "tpot", "itl", "e2el")
_ITEM = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>\d+(\.\d+)?)=(?P<value>\d+(\.\d+)?)(?P<unit>ms|s)?$")


@dataclass(frozen=True)
class SLO:
    metric: str
    percentile: float
    ms: float

    @property
    def key(self) -> str:
        """The bench result field it reads, e.g. p99_ttft_ms."""
        pct = f"{self.percentile:g}".replace(".", "_")
        return f"p{pct}_{self.metric}_ms"

    def __str__(self) -> str:
        return f"{self.metric}_p{self.percentile:g}={self.ms:g}ms"


def parse_slos(text: str) -> list[SLO]:
    if not text or not text.strip():
        raise ValueError("--slo needs at least one target, e.g. ttft_p99=500ms,tpot_p99=50ms")
    out = []
    for item in text.split(","):
        m = _ITEM.match(item.strip())
        if m is None:
            raise ValueError(f"bad SLO {item.strip()!r}: write METRIC_pPCT=VALUE[ms|s], e.g. ttft_p99=500ms")
        metric, pct = m["metric"], float(m["pct"])
        if metric not in METRICS:
            raise ValueError(f"bad SLO {item.strip()!r}: the metric must be one of {', '.join(METRICS)}")
        if not 0 < pct < 100:
            raise ValueError(f"bad SLO {item.strip()!r}: the percentile must be in (0, 100)")
        ms = float(m["value"]) * (1000.0 if m["unit"] == "s" else 1.0)
        if ms <= 0:
            raise ValueError(f"bad SLO {item.strip()!r}: the target must be positive")
        out.append(SLO(metric, pct, ms))
    if len({(s.metric, s.percentile) for s in out}) < len(out):
        raise ValueError(f"--slo names a target twice: {text!r}")
    return out


def per_request_slos(slos: list[SLO]) -> dict[str, float]:
    """The per-request thresholds goodput counts against (bench's goodput: ttft, tpot, e2el), the tightest
    target per metric."""
    out: dict[str, float] = {}
    for s in slos:
        if s.metric != "itl":
            out[s.metric] = min(s.ms, out.get(s.metric, s.ms))
    return out


def violation(result: dict, slos: list[SLO]) -> float:
    """How far the worst target is missed, as a ratio over 1 (0: every target met)."""
    worst = 0.0
    for s in slos:
        v = result.get(s.key)
        if v is None:
            return float("inf")
        worst = max(worst, v / s.ms - 1.0)
    return worst


def misses(result: dict, slos: list[SLO]) -> list[str]:
    """The targets a result misses, e.g. ['ttft_p99=500ms: 812 ms'], worst first."""
    out = [(result.get(s.key), s) for s in slos]
    bad = [(v / s.ms, f"{s}: {v:.0f} ms") for v, s in out if v is not None and v > s.ms]
    bad += [(float("inf"), f"{s}: not measured") for v, s in out if v is None]
    return [text for _, text in sorted(bad, reverse=True)]
