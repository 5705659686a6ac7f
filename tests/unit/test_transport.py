"""free_port: a port a server can still bind seconds later, whatever outgoing connections do meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

from gradwire import transport
from gradwire.transport import ephemeral_ports, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    low, _ = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        # The draw offers the busy port three times before a free one: the free one is the answer.
        draws = iter([busy, busy, busy, 12_345, 12_346])
        monkeypatch.setattr(transport.random, "randrange", lambda *_: next(draws))
        got = free_port(ephemeral=(40_000, 60_999))
        assert got != busy
        assert got in (12_345, 12_346)
        # No room below the range: bind(0) answers, which never hands out a bound port either.
        assert free_port(ephemeral=(10_500, 60_999)) != busy


def test_the_ephemeral_range_is_read_from_the_kernel_or_defaults(tmp_path: Path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ephemeral_ports(path) == (40000, 50000)
    assert ephemeral_ports(tmp_path / "missing") == (32768, 60999)
    path.write_text("garbage")
    assert ephemeral_ports(path) == (32768, 60999)
