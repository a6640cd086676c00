"""The engine's child processes (the engine core, parallel workers): `python -m <module>`, given one pickled
payload on stdin, which then stays open, so that its EOF tells the child that its parent died.

Each child gets a process group of its own, in its parent's session. A child stopped (SIGSTOP, a debugger)
when its parent dies could not run its EOF watcher and would stay stopped, holding its memory, forever; but
its group is then orphaned with a stopped member, and for that the kernel sends it SIGHUP and SIGCONT: it
exits (or, with SIGHUP ignored, wakes to the EOF). Terminal signals (Ctrl-C, Ctrl-Z) go to the foreground
group only, that is to the parent, which owns shutdown; a child ignores SIGTTOU, so that its log lines reach a
terminal set to `stty tostop` instead of stopping it. (Python 3.10's Popen has no `process_group`: there the
child makes its group itself, first thing.)
"""
from __future__ import annotations

import os
import pickle
import signal
import struct
import subprocess
import sys

_OWN_GROUP = {"process_group": 0} if sys.version_info >= (3, 11) else {}


def spawn_child(module: str, payload) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, **_OWN_GROUP)
    blob = pickle.dumps(payload)
    proc.stdin.write(struct.pack("<Q", len(blob)) + blob)
    proc.stdin.flush()  # stays open: its EOF tells the child that we died
    return proc


def read_payload():
    """The child's side: the payload its parent wrote to our stdin."""
    if os.getpgrp() != os.getpid():  # (Python 3.10: Popen could not give us a group of our own)
        os.setpgid(0, 0)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # (a background group's write to a `tostop` terminal)
    stdin = sys.stdin.buffer
    (size,) = struct.unpack("<Q", stdin.read(8))
    return pickle.loads(stdin.read(size))
