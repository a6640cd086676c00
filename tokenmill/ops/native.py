"""Builds and loads tokenmill's C kernels (ops/*.c): compiled once with the system's gcc into a cache
directory keyed by the hash of the source and of the shared headers (ops/*.h), loaded with ctypes.
Every kernel needs AVX512-BF16 (Zen 4, Sapphire Rapids and later); without it, or without gcc, `load`
returns None and callers keep their torch path."""
from __future__ import annotations

import ctypes
import hashlib
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger("tokenmill")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cache_dir() -> Path:
    base = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(base) / "ops"


def build(src_path: Path) -> Path:
    """Compile `src_path` against the headers in ops/ (once: the cached library is keyed by the source, those
    headers and the flags) and return the shared library's path. Raises OSError or CalledProcessError."""
    ops_dir = Path(__file__).parent
    key = hashlib.sha256(src_path.read_bytes() + " ".join(FLAGS).encode())
    for header in sorted(ops_dir.glob("*.h")):
        key.update(header.read_bytes())
    out = cache_dir() / f"lib{src_path.stem}_{key.hexdigest()[:16]}.so"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            subprocess.run(["gcc", *FLAGS, f"-I{ops_dir}", str(src_path), "-o", str(tmp_out)], check=True,
                           capture_output=True)
            os.replace(tmp_out, out)  # atomic: concurrent processes never load a half-written file
    return out


@lru_cache(maxsize=None)
def load(source: str, disable_env: str) -> ctypes.CDLL | None:
    """`source`: a C file beside this module. Set `disable_env` in the environment to skip the kernel."""
    if os.environ.get(disable_env) or not cpu_has_avx512_bf16() or not shutil.which("gcc"):
        return None
    try:
        # torch already loaded libgomp, so all share one OpenMP runtime
        return ctypes.CDLL(str(build(Path(__file__).with_name(source))))
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("CPU kernel %s unavailable (%s); using the torch path", source, e)
        return None
