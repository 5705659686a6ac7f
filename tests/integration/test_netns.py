"""The WAN benchmark's building blocks (benchmarks/netns.py, benchmarks/wire.py): namespace setup and
teardown, shaping with tc, latency added in user space, and the byte counters - where root is available
(skipped with the reason elsewhere)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.netns import Lab, root_available
from benchmarks.wire import tun_available

OK, WHY = root_available()
pytestmark = pytest.mark.skipif(not OK, reason=WHY)

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5099)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
c.sendall(str(n).encode()); c.close()
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5099), timeout=30); t0 = time.monotonic()
c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
print(c.recv(64).decode(), time.monotonic() - t0)
"""


def transfer(lab: Lab, nbytes: int) -> float:
    """Send ``nbytes`` from host 1 to host 0 over TCP; seconds it took."""
    server = lab.popen(0, [sys.executable, "-c", SERVER, lab.hosts[0].address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = lab.popen(
            1, [sys.executable, "-c", CLIENT, lab.hosts[0].address, str(nbytes)], stdout=subprocess.PIPE, text=True
        ).communicate(timeout=60)[0]
    finally:
        server.wait(30)
    received, seconds = out.split()
    assert int(received) == nbytes
    return float(seconds)


ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5099)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(1)):
    c.sendall(b)
"""
PING = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5099), timeout=30); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(5):
    t0 = time.monotonic(); c.sendall(b"x"); c.recv(1); times.append(time.monotonic() - t0)
print(min(times))
"""


def round_trip(lab: Lab) -> float:
    """The shortest of five one-byte TCP round trips from host 1 to host 0, in seconds."""
    server = lab.popen(0, [sys.executable, "-c", ECHO, lab.hosts[0].address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        out = lab.popen(
            1, [sys.executable, "-c", PING, lab.hosts[0].address], stdout=subprocess.PIPE, text=True
        ).communicate(timeout=60)[0]
    finally:
        server.wait(30)
    return float(out)


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_talk_over_the_bridge_and_the_counters_see_the_bytes() -> None:
    with Lab(2, tag="gwt1") as lab:
        before = [lab.counters(i) for i in range(2)]
        transfer(lab, 3_000_000)
        sent = lab.counters(1)["tx"] - before[1]["tx"]
        got = lab.counters(0)["rx"] - before[0]["rx"]
        assert 3_000_000 <= sent < 3_300_000 and 3_000_000 <= got < 3_300_000  # payload + TCP/IP headers
        assert "gwt1h0" in namespaces()
    assert "gwt1h" not in namespaces()
    assert subprocess.run(["ip", "link", "show", "gwt1br"], capture_output=True).returncode != 0  # the bridge went too


def test_the_links_are_shaped_to_the_bandwidth() -> None:
    with Lab(2, bandwidth="16mbit", tag="gwt2") as lab:
        seconds = transfer(lab, 4_000_000)
    rate = 4_000_000 * 8 / seconds / 1e6
    assert 10 < rate < 17.5, f"{rate:.1f} Mbit/s on a 16 Mbit/s link"


def test_a_failed_setup_leaves_nothing_behind() -> None:
    with pytest.raises(RuntimeError):
        with Lab(2, bandwidth="not-a-rate", tag="gwt3"):
            pass
    time.sleep(0.1)
    assert "gwt3h" not in namespaces()


@pytest.mark.skipif(not tun_available()[0], reason=tun_available()[1])
def test_latency_in_user_space_delays_every_packet_and_keeps_the_shaping_and_counters() -> None:
    with Lab(2, bandwidth="16mbit", latency=0.04, tag="gwt4") as lab:
        assert "gwt4h1" in namespaces()
        rtt = round_trip(lab)
        assert 0.08 <= rtt < 0.2, f"round trip {rtt * 1e3:.0f} ms with 40 ms each way"
        before = [lab.counters(i) for i in range(2)]
        seconds = transfer(lab, 4_000_000)
        sent = lab.counters(1)["tx"] - before[1]["tx"]
        got = lab.counters(0)["rx"] - before[0]["rx"]
        assert 4_000_000 <= sent < 4_400_000 and 4_000_000 <= got < 4_400_000
        assert lab.wire is not None and lab.wire.delivered[0] > 0 and lab.wire.delivered[1] > 0
    rate = 4_000_000 * 8 / seconds / 1e6
    assert 8 < rate < 17.5, f"{rate:.1f} Mbit/s on a 16 Mbit/s link"
    time.sleep(0.1)
    assert "gwt4h" not in namespaces()
    assert subprocess.run(["ip", "link", "show", "gwt4t0"], capture_output=True).returncode != 0  # the TUNs went too


def test_without_latency_the_round_trip_is_short() -> None:
    with Lab(2, tag="gwt5") as lab:
        assert round_trip(lab) < 0.02
