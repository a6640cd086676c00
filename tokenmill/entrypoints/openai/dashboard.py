"""`/dashboard`: a live page of what the server is doing, from the engine's own numbers; no external
service. The page (static/dashboard.html) polls `/dashboard/data` once a second and draws with uPlot,
shipped in the package (static/uPlot.*, MIT) so it works offline.

/dashboard/data carries what /metrics carries, so it is open the same way (guard.py PUBLIC_PATHS): an
`--api-key` protects the API, not its gauges.
"""
from __future__ import annotations

import time
from pathlib import Path

import msgspec
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse

from tokenmill.engine.live_window import CpuMeter

STATIC = Path(__file__).parent / "static"
FILES = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css"}
ENGINE_FIELDS = ("num_running", "num_waiting", "kv_cache_usage", "prefix_cache_hit_rate", "num_preemptions",
                 "spec_acceptance_rate", "spec_mean_acceptance_length", "spec_num_drafts", "num_steps",
                 "comm_seconds", "num_loading_kv")


def add_dashboard_routes(app: FastAPI, engine) -> None:
    cpu, gpu = CpuMeter(), GpuMeter()

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        return FileResponse(STATIC / "dashboard.html", media_type="text/html")

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in FILES:
            return JSONResponse({"error": "not found"}, status_code=404)
        return FileResponse(STATIC / name, media_type=FILES[name], headers={"cache-control": "max-age=3600"})

    @app.get("/dashboard/data", include_in_schema=False)
    async def data():
        stats = await engine.get_stats()
        s = msgspec.to_builtins(stats) if stats is not None else {}
        m = engine.metrics
        return JSONResponse({
            "time": time.time(),
            "engine": {k: s.get(k) for k in ENGINE_FIELDS},
            "kv_tier_hit_tokens": sum(t.get("hit_tokens", 0) for t in s.get("kv_tiers", {}).values()),
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "window": m.window.snapshot(),
            "output_tokens_total": m.output_tokens_streamed,
            "queue_depth": engine.num_pending,
            "cpu_percent": cpu.percent(),
            "gpu_percent": gpu.percent(),
        })


class GpuMeter:
    """GPU utilization through NVML, when pynvml is installed and a GPU is present (looked up once)."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            from tokenmill.nvml import device_handle
            self._pynvml, self._handle = pynvml, device_handle(pynvml)  # the engine's cuda:0
        except Exception:
            self._handle = None

    def percent(self) -> float | None:
        if self._handle is None:
            return None
        try:
            return float(self._pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        except Exception:
            return None
