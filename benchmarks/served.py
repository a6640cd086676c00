"""`tokenmill serve` as a subprocess for the server benchmarks (soak, stall probe): start it on a free
loopback port, wait for /health, find the engine core's pid, read both processes' RSS, stop it
(tokenmill.entrypoints.server_process has the parts tune and the tests share)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tokenmill.entrypoints.server_process import free_port, stop, wait_until_up

ROOT = Path(__file__).resolve().parent.parent


def rss_mib(pid: int) -> float:
    """Resident set size of one process (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Served:
    def __init__(self, *serve_args: str, log_path: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill", "serve", "--port", str(self.port), "--served-model-name", "bench",
               "--disable-log-requests", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
               *serve_args]
        # the benchmark measures this checkout, whatever `pip install -e` points at
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.core_pid: int | None = None

    def wait_ready(self, timeout: float = 300) -> None:
        wait_until_up(self.proc, self.url + "/health", timeout)
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        self.core_pid = int(children[0])

    def rss(self) -> dict:
        return {"api_mib": rss_mib(self.proc.pid), "core_mib": rss_mib(self.core_pid)}

    def stop(self, timeout: float = 60) -> int:
        return stop(self.proc, timeout)

    def __enter__(self) -> "Served":
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
