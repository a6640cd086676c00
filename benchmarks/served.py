"""`tokenmill serve` as a subprocess for the server benchmarks (soak, stall probe): start it on a free
loopback port, wait for /health, find the engine core's pid, read both processes' RSS, stop it.
(`free_port` and `stop` serve the tests' server fixture too.)"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGTERM (the server drains), SIGKILL if it is still there after `timeout`; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                    self.core_pid = int(children[0])
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"server not ready after {timeout}s")

    def rss(self) -> dict:
        return {"api_mib": rss_mib(self.proc.pid), "core_mib": rss_mib(self.core_pid)}

    def stop(self, timeout: float = 60) -> int:
        return stop(self.proc, timeout)

    def __enter__(self) -> "Served":
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
