"""The engine's child processes (the engine core, parallel workers): `python -m <module>`, given one pickled
payload on stdin, which then stays open, so that its EOF tells the child that its parent died.

Each child gets a process group of its own, in its parent's session. A child stopped (SIGSTOP, a debugger)
when its parent dies could not run its EOF watcher and would stay stopped, holding its memory, forever; but
its group is then orphaned with a stopped member, and for that the kernel sends it SIGHUP and SIGCONT: it
exits (or, with SIGHUP ignored, wakes to the EOF). Terminal signals (Ctrl-C, Ctrl-Z) go to the foreground
group only, that is to the parent, which owns shutdown.
"""
from __future__ import annotations

import pickle
import struct
import subprocess
import sys


def spawn_child(module: str, payload) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, process_group=0)
    blob = pickle.dumps(payload)
    proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
    proc.stdin.flush()  # stays open: its EOF tells the child that we died
    return proc


def read_payload():
    """The child's side: the payload its parent wrote to our stdin."""
    stdin = sys.stdin.buffer
    (size,) = struct.unpack("<Q", stdin.read(8))
    return pickle.loads(stdin.read(size))
