"""The resource monitor's utilization: busy time over wall time and usable cores, never past 100 %."""
import time

import pytest

from tokenmill.bench.resources import ResourceMonitor, _cores, _utilization


def test_utilization_is_busy_time_over_wall_time_and_cores_and_stops_at_100():
    assert _utilization(0.1, 0.1, 2) == pytest.approx(50.0)
    assert _utilization(0.21, 0.1, 2) == 100.0  # lazy per-thread accounting can overshoot a short window
    assert _utilization(0.0, 0.0, 2) is None


def test_one_busy_thread_shows_as_one_core():
    with ResourceMonitor(interval_s=0.01) as mon:
        end = time.perf_counter() + 1.0  # the sampler thread and any neighbour stay small beside 1 s
        while time.perf_counter() < end:
            pass
    out = mon.summary()
    assert out["cpu_cores"] == _cores()
    assert 100 / _cores() * 0.4 < out["cpu_utilization"] <= min(100.0, 100 / _cores() * 1.25)
    assert out["peak_rss_mb"] > 0


def test_a_gpu_without_a_utilization_counter_stops_only_the_gpu_meter(monkeypatch):
    """A MIG slice's NVML handle raises on the utilization read: the sampling thread drops the GPU meter and
    keeps sampling memory (it used to end on the exception)."""
    import sys
    import types

    class NVMLError(Exception):
        pass

    calls = []

    def utilization(handle):
        calls.append(handle)
        raise NVMLError("Not Supported")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(NVMLError=NVMLError,
                                                                      nvmlDeviceGetUtilizationRates=utilization))
    mon = ResourceMonitor(interval_s=0.01)
    mon._nvml = "mig-handle"
    with mon:
        time.sleep(0.05)
        mon.peak_rss = 0  # sampled again below only if the thread is still alive
        time.sleep(0.1)
    assert calls == ["mig-handle"] and mon.gpu_util == []
    assert mon.peak_rss > 0 and mon._thread.is_alive() is False
