"""Worker ranks as Ray actors (`distributed_executor_backend="ray"`), for clusters that Ray already
manages. Ray only places and starts the ranks: each actor runs the same worker loop as a process the
engine starts itself (worker.py), over the same control channel and torch.distributed group.

    ray.init()                 connects to RAY_ADDRESS (or `ray start --head`), else starts a local cluster
    rank r > 0                 one actor, num_cpus = the rank's threads (num_gpus = 1 on CUDA)
    the rendezvous address     the driver's node IP as Ray sees it; shared memory only when every rank
                               landed on the driver's node
"""
from __future__ import annotations

import threading


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


class _RankActor:
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pid(self) -> int:
        import os

        return os.getpid()

    def run(self, args) -> None:
        from tokenmill.distributed.worker import run_worker

        run_worker(args)


class RayRank:
    """One actor, with the part of subprocess.Popen's interface the executor uses. A synchronous actor
    runs one method at a time, so its pid and node are read before `start` runs the worker loop."""

    stdin = None

    def __init__(self, actor):
        import ray

        self.actor = actor
        self.pid, self.node_ip = ray.get([actor.pid.remote(), actor.node_ip.remote()])
        self.returncode = None
        self._done = threading.Event()

    def start(self, args) -> None:
        self.ref = self.actor.run.remote(args)
        threading.Thread(target=self._join, daemon=True).start()

    def _join(self) -> None:
        import ray

        try:
            ray.get(self.ref)
            self.returncode = 0
        except Exception:  # the actor died (os._exit, a kill, a lost node)
            self.returncode = 1
        self._done.set()

    def poll(self):
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout=None):
        import subprocess

        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("ray actor", timeout)
        return self.returncode

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
        self._done.wait(10)


def ray_driver_address() -> str:
    import ray

    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    return ray.util.get_node_ip_address()


def create_ray_ranks(ranks: list[int], threads: int, gpus: bool) -> list[tuple[int, RayRank]]:
    import ray

    cls = ray.remote(num_cpus=threads, num_gpus=1 if gpus else 0)(_RankActor)
    return [(rank, RayRank(cls.remote())) for rank in ranks]
