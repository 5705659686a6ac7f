"""A link emulator in user space: hosts' TUN interfaces joined by a process that adds latency.

Where the kernel has no ``netem`` (this project's machines), latency has to be added outside it. Each host
(a network namespace) gets a TUN interface; ``Wire`` holds every TUN's file descriptor, reads the IPv4
packets a host sends and hands each to its destination host after ``delay`` seconds, paced to the
destination's download rate (a packet leaves when the link has finished the one before it, as a real
link serialises them). The upload side is shaped by the kernel (``tbf`` on the host's TUN). Every kind of
traffic (gRPC, gloo, plain TCP) crosses the same emulated link, so every method pays the same latency.

One thread, one ``selectors`` loop and a heap of packets in flight. The TUN MTU is large (16 KB): the
kernel segments TCP to it, so the loop moves a few hundred packets per second at 100 Mbit/s, not tens of
thousands, and its own CPU time stays small.
"""

from __future__ import annotations

import fcntl
import heapq
import itertools
import os
import selectors
import struct
import threading
import time
from collections.abc import Sequence

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 16384
MAX_PACKET = 65536


def tun_available() -> tuple[bool, str]:
    """Whether TUN interfaces can be made here, and if not why."""
    if not os.path.exists("/dev/net/tun"):
        return False, "/dev/net/tun is missing (the tun kernel module)"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return False, "/dev/net/tun is not readable and writable"
    return True, ""


def open_tun(name: str) -> int:
    """A new TUN interface ``name`` (IP packets, no extra header), non-blocking; its file descriptor."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def parse_rate(rate: str | None) -> float | None:
    """A tc rate (``100mbit``, ``1gbit``, ``500kbit``, ``12mbps``) in bits per second; None stays None."""
    if rate is None:
        return None
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0, "gbps": 8e9, "mbps": 8e6, "kbps": 8e3, "bps": 8.0}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * scale
            break
    raise ValueError(f"not a rate: {rate!r} (e.g. 100mbit)")


class Wire:
    """Moves packets between TUN descriptors ``fds`` (host i's is ``fds[i]``, its IPv4 address ``addresses[i]``)
    after ``delay`` seconds, each destination's download paced to ``rate`` bits per second (None: unpaced; a
    list: each host's own)."""

    def __init__(
        self, fds: list[int], addresses: list[str], delay: float, rate: float | None | Sequence[float | None] = None
    ) -> None:
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.fds = fds
        self.delay = delay
        self.rates = list(rate) if isinstance(rate, Sequence) else [rate] * len(fds)
        self.host_of = {bytes(int(o) for o in a.split(".")): i for i, a in enumerate(addresses)}
        self.delivered = [0] * len(fds)  # packets handed to each host
        self.dropped = 0  # not IPv4, or for no host here
        self._free_at = [0.0] * len(fds)  # when each host's download link is next idle
        self._heap: list[tuple[float, int, int, bytes]] = []
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="wire", daemon=True)

    def start(self) -> Wire:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        os.write(self._wake_w, b"x")
        self._thread.join(10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def route(self, packet: bytes, now: float) -> tuple[int, float] | None:
        """Where ``packet`` goes and when it arrives there (None: dropped). Updates the link's pacing."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            return None
        dest = self.host_of.get(packet[16:20])
        if dest is None:
            return None
        arrive = now + self.delay
        rate = self.rates[dest]
        if rate is not None:
            # The download link serialises: this packet starts once it is here and the link is free.
            arrive = max(arrive, self._free_at[dest]) + len(packet) * 8 / rate
            self._free_at[dest] = arrive
        return dest, arrive

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for fd in self.fds:
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        heap = self._heap
        while not self._stop.is_set():
            timeout = max(0.0, heap[0][0] - time.monotonic()) if heap else None
            for key, _ in sel.select(timeout):
                if key.fd == self._wake_r:
                    continue
                while True:  # drain: several packets may be waiting
                    try:
                        packet = os.read(key.fd, MAX_PACKET)
                    except BlockingIOError:
                        break
                    routed = self.route(packet, time.monotonic())
                    if routed is None:
                        self.dropped += 1
                        continue
                    dest, at = routed
                    heapq.heappush(heap, (at, next(self._seq), dest, packet))
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                _, _, dest, packet = heapq.heappop(heap)
                try:
                    os.write(self.fds[dest], packet)
                    self.delivered[dest] += 1
                except OSError:  # the host's queue is full or its interface is gone: lost, as on a link
                    self.dropped += 1
        sel.close()
