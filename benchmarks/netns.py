"""Test hosts on one machine: network namespaces joined by a bridge, links shaped with ``tc``, bytes counted.

The building blocks of ``benchmarks.wan`` (root needed): ``Lab(n, bandwidth="100mbit")`` creates ``n``
hosts, each a network namespace with one veth link to a shared bridge and an address in a private /24
that exists only inside this machine; every link is shaped both ways with a token bucket (``tbf``).
``Lab(n, latency=0.025)`` adds one-way latency between hosts in user space instead, since this kernel has
no ``netem``: the hosts' links are then TUN interfaces joined by ``benchmarks.wire.Wire`` (uploads shaped
by ``tbf``, downloads paced by the wire, each packet delivered ``latency`` seconds after it was sent).
``lab.popen(i, argv)`` runs a program on host
``i``; ``lab.counters(i)`` reads the bytes host ``i`` sent and received from the kernel's interface
statistics, so traffic is measured, not estimated. Leaving the ``with`` block removes every namespace,
link and the bridge, also after an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from benchmarks.wire import MTU, Wire, open_tun, parse_rate


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
    veth: str | None  # this machine's end of the host's link (on the bridge); None on a user-space wire
    peer: str  # the host's end, inside its namespace (a veth, or a TUN interface)


class Lab:
    """``hosts`` namespaces on one bridge, links shaped to ``bandwidth`` (a tc rate such as ``100mbit``);
    with ``latency`` (seconds, one way), on a user-space wire that delays every packet by that much."""

    def __init__(
        self,
        hosts: int,
        *,
        bandwidth: str | None = None,
        latency: float | None = None,
        tag: str | None = None,
        shaped: Collection[int] | None = None,
    ) -> None:
        """``shaped``: the hosts whose links ``bandwidth`` shapes (None: every host's); the others' are fast."""
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be in [1, 200], got {hosts}")
        if latency is not None and not 0 <= latency <= 10:
            raise ValueError(f"latency must be in [0, 10] seconds, got {latency}")
        self.tag = tag or f"gw{os.getpid() % 100000}"  # names stay under the kernel's 15 characters
        self.bandwidth = bandwidth
        self.latency = latency
        self.shaped = set(range(hosts)) if shaped is None else set(shaped)
        octet = 100 + os.getpid() % 100  # a /24 of 10.213.0.0/16 that exists inside this machine only
        self.bridge = f"{self.tag}br"
        wired = latency is not None
        self.hosts = [
            Host(
                f"{self.tag}h{i}",
                f"10.213.{octet}.{i + 2}",
                None if wired else f"{self.tag}v{i}",
                f"{self.tag}{'t' if wired else 'p'}{i}",
            )
            for i in range(hosts)
        ]
        self._made: list[tuple[str, str]] = []
        self._tuns: list[int] = []
        self.wire: Wire | None = None

    def __enter__(self) -> Lab:
        if self.latency is not None:
            return self._enter_wired()
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
                if self.bandwidth and self.hosts.index(h) in self.shaped:
                    self._shape(h)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _enter_wired(self) -> Lab:
        try:
            rate = parse_rate(self.bandwidth)
            for i, h in enumerate(self.hosts):
                _ip("netns", "add", h.netns)
                self._made.append(("netns", h.netns))
                # Made here, moved into the host: the descriptor keeps working across namespaces.
                self._tuns.append(open_tun(h.peer))
                _ip("link", "set", h.peer, "netns", h.netns)
                _ip("addr", "add", f"{h.address}/24", "dev", h.peer, netns=h.netns)
                _ip("link", "set", h.peer, "mtu", str(MTU), "up", netns=h.netns)
                _ip("link", "set", "lo", "up", netns=h.netns)
                if self.bandwidth and i in self.shaped:
                    _tc(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.peer, *self._tbf()])
            rates = [rate if i in self.shaped else None for i in range(len(self.hosts))]
            self.wire = Wire(self._tuns, [h.address for h in self.hosts], self.latency or 0.0, rates).start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _tbf(self) -> list[str]:
        return ["root", "tbf", "rate", str(self.bandwidth), "burst", "64kb", "latency", "100ms"]

    def _shape(self, h: Host) -> None:
        # Both directions: the bridge side's egress is the host's download, the host side's its upload.
        assert h.veth is not None
        for argv in (
            ["tc", "qdisc", "add", "dev", h.veth, *self._tbf()],
            ["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", h.peer, *self._tbf()],
        ):
            _tc(argv)

    def __exit__(self, *exc: object) -> None:
        if self.wire is not None:
            self.wire.stop()
            self.wire = None
        for fd in self._tuns:  # a TUN interface goes when its last descriptor closes
            os.close(fd)
        self._tuns.clear()
        for kind, name in reversed(self._made):  # links die with their namespace; the bridge last
            subprocess.run(["ip", kind, "del", name], capture_output=True)
        self._made.clear()

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Run ``argv`` on host ``host`` (in its namespace); gloo there needs ``GLOO_SOCKET_IFNAME`` = its peer."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.hosts[host].peer, **kwargs.pop("env", {})}
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[host].netns, *argv], env=env, **kwargs)

    def counters(self, host: int) -> dict[str, int]:
        """Bytes host ``host`` has sent (``tx``) and received (``rx``) over its link so far."""
        h = self.hosts[host]
        if h.veth is None:  # a TUN inside the host: its own statistics
            out = subprocess.run(
                ["ip", "-n", h.netns, "-j", "-s", "link", "show", "dev", h.peer],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            stats64 = json.loads(out)[0]["stats64"]
            return {"tx": int(stats64["tx"]["bytes"]), "rx": int(stats64["rx"]["bytes"])}
        stats = Path("/sys/class/net") / h.veth / "statistics"
        # The bridge side's receive is the host's send, and the other way round.
        return {"tx": int((stats / "rx_bytes").read_text()), "rx": int((stats / "tx_bytes").read_text())}

    def names(self) -> list[str]:
        return [*([] if self.latency is not None else [self.bridge]), *(h.netns for h in self.hosts)]


def _tc(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
