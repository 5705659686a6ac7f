"""Test hosts on one machine: network namespaces joined by a bridge, links shaped with ``tc``, bytes counted.

The building blocks of ``benchmarks.wan`` (root needed): ``Lab(n, bandwidth="100mbit")`` creates ``n``
hosts, each a network namespace with one veth link to a shared bridge and an address in a private /24
that exists only inside this machine; every link is shaped both ways with a token bucket (``tbf``; this
kernel may lack ``netem``, so latency is not added here). ``lab.popen(i, argv)`` runs a program on host
``i``; ``lab.counters(i)`` reads the bytes host ``i`` sent and received from the kernel's interface
statistics, so traffic is measured, not estimated. Leaving the ``with`` block removes every namespace,
link and the bridge, also after an error.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def root_available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not why."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return False, f"{' and '.join(missing)} not installed (Debian: iproute2)"
    probe = f"gwprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


@dataclasses.dataclass(frozen=True)
class Host:
    netns: str
    address: str
    veth: str  # this machine's end of the host's link (on the bridge)
    peer: str  # the host's end, inside its namespace


class Lab:
    """``hosts`` namespaces on one bridge, links shaped to ``bandwidth`` (a tc rate such as ``100mbit``)."""

    def __init__(self, hosts: int, *, bandwidth: str | None = None, tag: str | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        self.tag = tag or f"gw{os.getpid() % 100000}"  # names stay under the kernel's 15 characters
        self.bandwidth = bandwidth
        octet = 100 + os.getpid() % 100  # a /24 of 10.213.0.0/16 that exists inside this machine only
        self.bridge = f"{self.tag}br"
        self.hosts = [Host(f"{self.tag}h{i}", f"10.213.{octet}.{i + 2}", f"{self.tag}v{i}", f"{self.tag}p{i}") for i in range(hosts)]
        self._made: list[tuple[str, str]] = []

    def __enter__(self) -> Lab:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", self.bridge))
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts:
                _ip("netns", "add", h.netns)
                self._made.append(("netns", h.netns))
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.peer)
                self._made.append(("link", h.veth))
                _ip("link", "set", h.peer, "netns", h.netns)
                _ip("link", "set", h.veth, "master", self.bridge)
                _ip("link", "set", h.veth, "up")
                _ip("addr", "add", f"{h.address}/24", "dev", h.peer, netns=h.netns)
                _ip("link", "set", h.peer, "up", netns=h.netns)
                _ip("link", "set", "lo", "up", netns=h.netns)
                if self.bandwidth:
                    self._shape(h)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _shape(self, h: Host) -> None:
        # Both directions: the bridge side's egress is the host's download, the host side's its upload.
        tbf = ["root", "tbf", "rate", self.bandwidth, "burst", "64kb", "latency", "100ms"]
        for argv in (["tc", "qdisc", "add", "dev", h.veth, *tbf], ["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.peer, *tbf]):
            proc = subprocess.run(argv, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")

    def __exit__(self, *exc: object) -> None:
        for kind, name in reversed(self._made):  # links die with their namespace; the bridge last
            subprocess.run(["ip", kind, "del", name], capture_output=True)
        self._made.clear()

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Run ``argv`` on host ``host`` (in its namespace); gloo there needs ``GLOO_SOCKET_IFNAME`` = its peer."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.hosts[host].peer, **kwargs.pop("env", {})}
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host].netns, *argv], env=env, **kwargs)

    def counters(self, host: int) -> dict[str, int]:
        """Bytes host ``host`` has sent (``tx``) and received (``rx``) over its link so far."""
        stats = Path("/sys/class/net") / self.hosts[host].veth / "statistics"
        # The bridge side's receive is the host's send, and the other way round.
        return {"tx": int((stats / "rx_bytes").read_text()), "rx": int((stats / "tx_bytes").read_text())}

    def names(self) -> list[str]:
        return [self.bridge, *(h.netns for h in self.hosts)]
