"""benchmarks.wire's pure parts: rates, and where and when a packet arrives (no TUN or root needed)."""

from __future__ import annotations

import pytest

from benchmarks.wan import parse_latency
from benchmarks.wire import Wire, parse_rate

ADDRESSES = ["10.213.1.2", "10.213.1.3", "10.213.1.4"]


def ipv4(dest: str, size: int = 1000) -> bytes:
    header = bytes([0x45]) + bytes(15) + bytes(int(o) for o in dest.split("."))
    return header + bytes(size - len(header))


def test_rates_in_tc_units() -> None:
    assert parse_rate("100mbit") == 100e6 and parse_rate("1gbit") == 1e9 and parse_rate("500kbit") == 500e3
    assert parse_rate("12mbps") == 96e6 and parse_rate(None) is None
    for bad in ("fast", "-5mbit", "0mbit", "mbit"):
        with pytest.raises(ValueError, match="not a rate"):
            parse_rate(bad)


def test_latency_flag() -> None:
    assert (
        parse_latency("25ms") == 0.025
        and parse_latency("0.1s") == 0.1
        and parse_latency("40") == 0.04
        and parse_latency("0") == 0
    )
    for bad in ("soon", "-1ms", "11s"):
        with pytest.raises(Exception, match="latency"):
            parse_latency(bad)


def test_a_packet_arrives_at_its_destination_after_the_delay() -> None:
    wire = Wire([0, 1, 2], ADDRESSES, delay=0.025)
    assert wire.route(ipv4("10.213.1.4"), now=10.0) == (2, pytest.approx(10.025))
    assert wire.route(ipv4("10.213.1.2"), now=11.0) == (0, pytest.approx(11.025))


def test_a_download_link_serialises_its_packets_at_the_rate() -> None:
    wire = Wire([0, 1, 2], ADDRESSES, delay=0.01, rate=8e6)  # 1 MB/s: a 1000-byte packet takes 1 ms
    arrivals = [wire.route(ipv4("10.213.1.3"), now=0.0)[1] for _ in range(5)]
    assert arrivals == pytest.approx([0.011, 0.012, 0.013, 0.014, 0.015])
    # Another host's link is idle: its first packet only waits for the delay and its own transmission.
    assert wire.route(ipv4("10.213.1.4"), now=0.0)[1] == pytest.approx(0.011)
    # Once the queue has drained, a packet waits for nothing but the delay again.
    assert wire.route(ipv4("10.213.1.3"), now=1.0)[1] == pytest.approx(1.011)


def test_packets_for_no_host_here_or_not_ipv4_are_dropped() -> None:
    wire = Wire([0, 1], ADDRESSES[:2], delay=0.0)
    assert wire.route(ipv4("192.168.0.1"), now=0.0) is None
    assert wire.route(bytes([0x60]) + bytes(59), now=0.0) is None  # IPv6
    assert wire.route(b"\x45\x00", now=0.0) is None  # truncated
    with pytest.raises(ValueError):
        Wire([0], ADDRESSES[:1], delay=-1.0)
