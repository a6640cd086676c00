"""glibc malloc thresholds (tokenmill/cpu_malloc.py): once an engine is built, a tensor-sized block comes
from the heap, where a freed one is reused warm, not from a fresh mmap whose pages fault on first touch
every time."""
import os
import subprocess
import sys

import pytest

from tokenmill.cpu_malloc import tune_for_steps

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")

# mallinfo2().hblkhd: the bytes glibc holds in mmapped blocks
_PROBE = """
import ctypes
import tokenmill, torch
from tokenmill.config import DEFAULT_MODEL
llm = tokenmill.LLM(model=DEFAULT_MODEL)  # the thresholds rise once the model and KV cache are in place
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
                                              "keepcost").split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblkhd
x = torch.empty(40 << 20, dtype=torch.uint8)  # 40 MiB, above glibc's largest default mmap threshold
print(libc.mallinfo2().hblkhd - before)
"""


def mmapped_bytes_of_a_40_mib_tensor(**env) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, **env})
    return int(out.stdout.strip().splitlines()[-1])


def test_after_the_engine_loads_a_40_mib_tensor_comes_from_the_heap_not_a_fresh_mmap():
    try:
        untuned = mmapped_bytes_of_a_40_mib_tensor(TOKENMILL_MALLOC_DEFAULTS="0")
    except subprocess.CalledProcessError:
        pytest.skip("no mallinfo2 (glibc < 2.33)")
    assert untuned >= 40 << 20
    assert mmapped_bytes_of_a_40_mib_tensor() == 0


def test_the_users_own_malloc_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not tune_for_steps()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("TOKENMILL_MALLOC_DEFAULTS", "0")
    assert not tune_for_steps()
