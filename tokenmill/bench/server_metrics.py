"""Speculative-decoding figures for `bench serve`, from the server's Prometheus counters before and after the
run (tokenmill's `tokenmill:spec_decode_*` or vLLM's `vllm:spec_decode_*`; any other prefix is read too).

The counters are cumulative over the server's life, so a run's figures are the differences: acceptance
rate = accepted / drafted tokens, mean acceptance length = 1 + accepted / verification steps, as vLLM
defines them. A server without /metrics, or without speculation, gives no figures (None), not an error.
"""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POS = "num_accepted_tokens_per_pos"


def parse_spec_counters(text: str) -> dict | None:
    """{num_drafts, num_draft_tokens, num_accepted_tokens: float, per_pos: {position: float}} summed over
    label sets (models), or None when the text has no spec-decode counters."""
    out: dict = {name: 0.0 for name in COUNTERS}
    out["per_pos"] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        name = family.name.rsplit(":", 1)[-1].removeprefix("spec_decode_")
        if not family.name.rsplit(":", 1)[-1].startswith("spec_decode_") or family.type != "counter":
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the _created timestamps
            if name == PER_POS:
                pos = int(sample.labels.get("position", 0))
                out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + sample.value
                seen = True
            elif name in COUNTERS:
                out[name] += sample.value
                seen = True
    return out if seen else None


def spec_decode_delta(before: dict | None, after: dict | None) -> dict | None:
    """The run's figures in `bench offline`'s `spec_decode` layout, or None without verification steps."""
    if after is None:
        return None
    before = before or {name: 0.0 for name in COUNTERS} | {"per_pos": {}}
    d = {name: int(after[name] - before[name]) for name in COUNTERS}
    if d["num_drafts"] <= 0:
        return None
    width = max(after["per_pos"], default=-1) + 1
    per_pos = [int(after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0)) for i in range(width)]
    return {"num_drafts": d["num_drafts"], "num_draft_tokens": d["num_draft_tokens"],
            "num_accepted_tokens": d["num_accepted_tokens"], "accepted_per_pos": per_pos,
            "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else 0.0,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"], "source": "server /metrics"}


async def scrape_spec_counters(session: aiohttp.ClientSession, base_url: str, headers: dict) -> dict | None:
    """The server's spec-decode counters now; None if /metrics is missing, refused or has none."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return parse_spec_counters(await r.text())
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
