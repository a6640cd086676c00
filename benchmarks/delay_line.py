"""Two "nodes" on one machine: network namespaces tm0 and tm1 joined by a user-space link with a fixed
one-way delay and a bandwidth cap, for the cross-node parallelism benchmark (bench_parallel.py netem).

This kernel has no sch_netem (`tc qdisc add ... netem` fails: "Specified qdisc kind is unknown"), so the
link is two TUN devices, one per namespace, and a forwarder process that holds each packet for
`delay_ms` and paces each direction at `rate_gbit`:

    tm0: tmt0 10.77.0.1/24  <-- fd --> [forwarder: FIFO, departure = max(now, last) + size / rate,
                                        arrival = departure + delay]  <-- fd -->  tm1: tmt1 10.77.0.2/24

The MTU is 64000 so that the forwarder handles few packets per second (Python costs ~10 us each).
Run `python delay_line.py up --delay-ms 1 --rate-gbit 10` (stays in the foreground) and stop it with
SIGTERM; `down` removes the namespaces.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections import deque

TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
NODES = (("tm0", "tmt0", "10.77.0.1"), ("tm1", "tmt1", "10.77.0.2"))
MTU = 64000


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def down() -> None:
    for ns, _, _ in NODES:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def up() -> list[int]:
    down()
    fds = []
    for ns, dev, addr in NODES:
        sh("ip", "netns", "add", ns)
        fds.append(open_tun(dev))
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
    return fds


def forward(fds: list[int], delay_s: float, rate_bps: float) -> None:
    queues = {0: deque(), 1: deque()}  # direction (from fd index) -> (arrival time, packet)
    last_departure = {0: 0.0, 1: 0.0}
    for fd in fds:
        os.set_blocking(fd, False)
    while True:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else 0.5
        ready, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for i, fd in enumerate(fds):
            if fd not in ready:
                continue
            while True:
                try:
                    pkt = os.read(fd, MTU + 64)
                except BlockingIOError:
                    break
                depart = max(now, last_departure[i]) + len(pkt) * 8 / rate_bps
                last_departure[i] = depart
                queues[i].append((depart + delay_s, pkt))
        for i, q in queues.items():
            out = fds[1 - i]
            while q and q[0][0] <= now:
                try:
                    os.write(out, q.popleft()[1])
                except OSError:
                    pass  # a full device queue drops the packet, as a real link would


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=("up", "down"))
    ap.add_argument("--delay-ms", type=float, default=1.0)
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    args = ap.parse_args()
    if args.action == "down":
        down()
        return
    fds = up()
    signal.signal(signal.SIGTERM, lambda *_: (down(), sys.exit(0)))
    print("link up", flush=True)
    try:
        forward(fds, args.delay_ms / 1e3, args.rate_gbit * 1e9)
    finally:
        down()


if __name__ == "__main__":
    main()
