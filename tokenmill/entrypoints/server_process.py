"""`tokenmill serve` run as a child process, for the callers that measure one: `tokenmill tune`'s trials,
the server benchmarks and the tests' server fixture. A free loopback port, a wait for /health that fails
fast when the process exits, and a stop that lets the server drain first."""
from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (the server binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, timeout: float, logs=lambda: "") -> None:
    """Poll `url` until it answers 200. Raises RuntimeError at once if the process exits, TimeoutError after
    `timeout` seconds; both messages end with `logs()` (e.g. the tail of the server's log)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{logs()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{logs()}")


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
