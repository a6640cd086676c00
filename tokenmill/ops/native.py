"""Builds and loads tokenmill's C kernels (ops/*.c): compiled once with the system's gcc for this CPU
(-march=native) into a cache directory, loaded with ctypes.

Each kernel has two paths in its C source, chosen by the compiler's target macros: AVX-512 intrinsics
(Zen 4, Sapphire Rapids and later; bfloat16 dot products need AVX512-BF16) and portable C that gcc
auto-vectorizes for whatever the CPU has. `load` takes any x86-64 CPU with AVX2 and FMA (the portable
path is measured there; it is the floor where it beats torch's small-matrix ops); without them, or
without gcc, it returns None and callers keep their torch path.

Because -march=native bakes the CPU's instruction set into the library, the cache key holds the CPU's
feature flags (and the compiler) besides the source, the shared headers (ops/*.h) and the flags: a cache
directory shared by machines never hands one CPU's build to another.

TOKENMILL_NATIVE_PORTABLE=1 builds the portable paths even on an AVX-512 CPU (to test them there)."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger("tokenmill")
# no -ffast-math: the kernels round where their torch twins round, and bf16 results must match them
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
PORTABLE_FLAGS = ["-mno-avx512f"]  # turns off every AVX-512 extension, so each file takes its #else path
REQUIRED_FLAGS = frozenset({"avx2", "fma"})


def cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags()


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first `field` line's value in /proc/cpuinfo (Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), "")
    except OSError:
        return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags."""
    return frozenset(_cpuinfo("flags").split())


def cpu_supported() -> bool:
    """x86-64 with AVX2 and FMA (every AVX-512 CPU has both)."""
    return platform.machine().lower() in ("x86_64", "amd64") and REQUIRED_FLAGS <= cpu_flags()


def compile_flags() -> list[str]:
    return (FLAGS + (PORTABLE_FLAGS if os.environ.get("TOKENMILL_NATIVE_PORTABLE") else [])
            + ([] if stream_prefetch() else ["-DTM_NO_STREAM_PREFETCH"]))


def stream_prefetch() -> bool:
    """Whether the weight-streaming kernels ask for their stream's lines ahead in software (ops/stream.h). On an
    Intel AMX VM that tripled the int4 GEMV's stream; on a Zen 4 EPYC the hardware prefetchers do better alone:
    the bf16 GEMV read 48-53 GB/s without it against 37-41 with it, with the read probe at 50-55 (BENCHMARKS.md,
    "Weight streams without software prefetch on AMD"). So off on AMD CPUs; TOKENMILL_STREAM_PREFETCH=0 or 1
    decides instead."""
    env = os.environ.get("TOKENMILL_STREAM_PREFETCH")
    if env in ("0", "1"):
        return env == "1"
    return cpu_vendor() != "AuthenticAMD"


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ...; empty where /proc/cpuinfo does not say."""
    return _cpuinfo("vendor_id")


@functools.cache
def compiler_version() -> str:
    try:
        return subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError):
        return ""


def cache_dir() -> Path:
    base = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    return Path(base) / "ops"


def library_path(src_paths: list[Path]) -> Path:
    """Where the build of `src_paths` (linked into one library) for this CPU, compiler and flags is cached."""
    ops_dir = Path(__file__).parent
    key = hashlib.sha256()
    for src in src_paths:
        key.update(src.name.encode() + b"\0" + src.read_bytes())
    for header in sorted(ops_dir.glob("*.h")):
        key.update(header.name.encode() + b"\0" + header.read_bytes())
    key.update("\0".join([" ".join(compile_flags()), compiler_version(), platform.machine(),
                          " ".join(sorted(cpu_flags()))]).encode())
    return cache_dir() / f"lib{src_paths[0].stem}_{key.hexdigest()[:16]}.so"


def build(src_paths: list[Path]) -> Path:
    """Compile `src_paths` into one library against the headers in ops/ (once per sources, headers, flags,
    compiler and CPU) and return its path. Raises OSError or CalledProcessError."""
    out = library_path(src_paths)
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            subprocess.run(["gcc", *compile_flags(), f"-I{Path(__file__).parent}", *map(str, src_paths), "-o", str(tmp_out)],
                           check=True, capture_output=True)
            os.replace(tmp_out, out)  # atomic: concurrent processes never load a half-written file
    return out


@lru_cache(maxsize=None)
def load(source: str, disable_env: str, links: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`source`: a C file beside this module, linked with the files in `links` (whose exported kernels it
    calls). Set `disable_env` in the environment to skip the kernel."""
    if os.environ.get(disable_env) or not cpu_supported() or not shutil.which("gcc"):
        return None
    try:
        # torch already loaded libgomp, so all share one OpenMP runtime
        return ctypes.CDLL(str(build([Path(__file__).with_name(f) for f in (source, *links)])))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (e.stderr or b"").decode(errors="replace")[-2000:] if isinstance(e, subprocess.CalledProcessError) else ""
        logger.warning("CPU kernel %s unavailable (%s); using the torch path\n%s", source, e, detail)
        return None
