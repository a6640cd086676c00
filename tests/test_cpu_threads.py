"""tokenmill's OpenMP defaults reach the runtime (libgomp prints what it read with OMP_DISPLAY_ENV), a user's
own settings win, and importing torch first is detected."""
import os
import subprocess
import sys

import pytest

from tokenmill.cpu_threads import OPENMP_DEFAULTS


def _openmp_env(code: str, **env) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    out = subprocess.run([sys.executable, "-c", code], env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout + out.stderr


@pytest.mark.parametrize("entry", ["import tokenmill", "import tokenmill.engine.core_proc"])
def test_defaults_reach_libgomp(entry):
    shown = _openmp_env(entry)
    for key, value in OPENMP_DEFAULTS.items():
        assert f"{key} = '{value}'" in shown


def test_user_settings_win():
    shown = _openmp_env("import tokenmill", OMP_WAIT_POLICY="ACTIVE")
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in shown
    assert all(f"{k} = '{v}'" not in shown for k, v in OPENMP_DEFAULTS.items())


def test_torch_imported_first_is_detected():
    shown = _openmp_env("import torch, tokenmill.cpu_threads as c; print('late', c.applied_too_late)")
    assert "late True" in shown
