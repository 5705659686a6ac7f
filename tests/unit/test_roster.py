"""The run's workers (coordinator.membership.Roster): joins, leaves, benching, with fake links and sources."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc
import pytest

from gradwire.coordinator.decisions import Standing
from gradwire.coordinator.membership import Roster
from gradwire.link import WorkerError
from gradwire.protocol import WorkerInfo


class FakeLink:
    """A worker link that records what the roster asked of it; ``fail`` makes a call raise ``WorkerError``."""

    def __init__(
        self, address: str, *, device: str = "cpu", ranks: int = 1, node_mode: str = "", fail: Sequence[str] = ()
    ) -> None:
        self.address = address
        self.info = WorkerInfo(4, "0.1.0", "2.9.0", device, device_name="test device", ranks=ranks, node_mode=node_mode)
        self.fail = set(fail)
        self.calls: list[tuple[str, object]] = []
        self.closed = False

    def _call(self, name: str, arg: object = None) -> None:
        self.calls.append((name, arg))
        if name in self.fail:
            raise WorkerError(self.address, grpc.StatusCode.UNAVAILABLE, f"{name} failed")

    def wait_ready(self, timeout: float | None = None) -> None:
        self._call("wait_ready", timeout)

    def describe(self, timeout: float | None = None) -> WorkerInfo:
        self._call("describe")
        return self.info

    def close(self) -> None:
        self.closed = True

    def close_run(self, run_id: str, timeout: float | None = None) -> bool:
        self._call("close_run", (run_id, timeout))
        return True


class FakeSource:
    """A member source answering ``polls`` in turn (then ``None``: no change), counting ``forget`` calls."""

    def __init__(self, *polls: list[str] | None) -> None:
        self.polls = list(polls)
        self.forgotten = 0

    def poll(self) -> list[str] | None:
        return self.polls.pop(0) if self.polls else None

    def forget(self) -> None:
        self.forgotten += 1


class Connector:
    """``connect``: makes (and keeps) a ``FakeLink`` per address, as told by ``links``."""

    def __init__(self, **links: FakeLink) -> None:
        self.links = links
        self.made: list[str] = []

    def __call__(self, address: str) -> FakeLink:
        self.made.append(address)
        return self.links.get(address) or FakeLink(address)


def addresses(roster: Roster) -> list[tuple[int, str]]:
    return [(s.index, s.client.address) for s in roster.slots]


def test_a_roster_needs_a_worker_and_a_source_needs_a_factory() -> None:
    with pytest.raises(ValueError, match="--workers \\(or --local N\\) must name at least one worker"):
        Roster([])
    with pytest.raises(ValueError, match="--workers-file and --listen need a client factory"):
        Roster([FakeLink("a:1")], source=FakeSource())


def test_the_slots_are_the_links_in_order() -> None:
    links = [FakeLink("a:1"), FakeLink("b:1")]
    roster = Roster(links)
    assert addresses(roster) == [(0, "a:1"), (1, "b:1")]
    assert all(s.client is link for s, link in zip(roster.slots, links))
    roster.update(0)  # no source: the fixed links
    assert addresses(roster) == [(0, "a:1"), (1, "b:1")]


def test_describe_all_takes_each_workers_ranks_device_and_node_mode() -> None:
    links = [FakeLink("a:1", device="cuda:0", ranks=4, node_mode="fsdp"), FakeLink("b:1")]
    roster = Roster(links, connect_timeout=7.0)
    roster.describe_all()
    assert [(s.ranks, s.device, s.node_mode) for s in roster.slots] == [(4, "cuda:0", "fsdp"), (1, "cpu", "")]
    assert links[0].calls == [("wait_ready", 7.0), ("describe", None)]


def test_joiners_get_fresh_slots_and_leavers_are_dropped_and_closed() -> None:
    source = FakeSource(["a:1", "b:1", "c:1"], None, ["a:1", "c:1"], ["a:1", "c:1", "d:1"])
    connect = Connector(**{"c:1": FakeLink("c:1", device="cuda:1", ranks=2, node_mode="ddp")})
    a, b = FakeLink("a:1"), FakeLink("b:1")
    roster = Roster([a, b], source=source, connect=connect, connect_timeout=60.0)

    roster.update(0)
    assert addresses(roster) == [(0, "a:1"), (1, "b:1"), (2, "c:1")]
    joined = roster.slots[2]
    assert (joined.ranks, joined.device, joined.node_mode, joined.version) == (2, "cuda:1", "ddp", None)  # no state yet
    assert connect.links["c:1"].calls == [("wait_ready", 5.0), ("describe", None)]  # a short readiness check

    roster.update(1)  # no change
    assert addresses(roster) == [(0, "a:1"), (1, "b:1"), (2, "c:1")]

    roster.update(2)
    assert addresses(roster) == [(0, "a:1"), (2, "c:1")]
    assert b.closed and not a.closed

    roster.update(3)
    assert addresses(roster) == [(0, "a:1"), (2, "c:1"), (3, "d:1")]  # index 1 is never reused
    assert connect.made == ["c:1", "d:1"]
    assert source.forgotten == 0


def test_the_readiness_check_is_no_longer_than_the_connect_timeout() -> None:
    connect = Connector()
    roster = Roster([FakeLink("a:1")], source=FakeSource(["a:1", "b:1"]), connect=connect, connect_timeout=2.0)
    roster.update(0)
    assert roster.slots[1].client.calls[0] == ("wait_ready", 2.0)  # type: ignore[attr-defined]


def test_the_last_worker_is_kept_when_its_list_drops_it(caplog: pytest.LogCaptureFixture) -> None:
    a = FakeLink("a:1")
    roster = Roster([a], source=FakeSource([]), connect=Connector())
    with caplog.at_level(logging.WARNING, logger="gradwire.coordinator.membership"):
        roster.update(4)
    assert addresses(roster) == [(0, "a:1")] and not a.closed
    assert "the run's last worker (a:1) left its list; keeping it" in caplog.text


def test_of_several_leavers_the_last_one_stays() -> None:
    a, b = FakeLink("a:1"), FakeLink("b:1")
    roster = Roster(
        [a, b], source=FakeSource(["z:1"]), connect=Connector(**{"z:1": FakeLink("z:1", fail=["wait_ready"])})
    )
    roster.update(0)
    assert addresses(roster) == [(1, "b:1")]  # z is not ready: b is all the run has left
    assert a.closed and not b.closed


def test_a_replaced_last_worker_leaves_once_its_replacement_joined() -> None:
    """The list moves the run from a to b: once b has joined, a is no longer the run's last worker."""
    a = FakeLink("a:1")
    roster = Roster([a], source=FakeSource(["b:1"]), connect=Connector())
    roster.update(0)
    assert addresses(roster) == [(1, "b:1")]
    assert a.closed


@pytest.mark.parametrize("failing", ["wait_ready", "describe"])
def test_a_joiner_not_ready_is_skipped_and_retried_next_round(failing: str) -> None:
    flaky = FakeLink("c:1", fail=[failing])
    source = FakeSource(["a:1", "c:1"], ["a:1", "c:1"])
    connect = Connector(**{"c:1": flaky})
    roster = Roster([FakeLink("a:1")], source=source, connect=connect)

    roster.update(0)
    assert addresses(roster) == [(0, "a:1")]
    assert flaky.closed  # its link released
    assert source.forgotten == 1  # the source answers again next poll, changed or not

    flaky.fail.clear()
    roster.update(1)
    assert addresses(roster) == [(0, "a:1"), (1, "c:1")]  # the failed try took no index
    assert connect.made == ["c:1", "c:1"] and source.forgotten == 1


def test_active_leaves_out_the_benched_unless_all_are() -> None:
    roster = Roster([FakeLink("a:1"), FakeLink("b:1"), FakeLink("c:1")])
    roster.slots[1].standing = Standing(0, until=5)
    assert [s.index for s in roster.active(3)] == [0, 2]
    assert [s.index for s in roster.active(5)] == [0, 1, 2]  # benched before step 5 only
    for slot in roster.slots:
        slot.standing = Standing(0, until=9)
    assert [s.index for s in roster.active(3)] == [0, 1, 2]  # every one benched: try them all


def test_close_sessions_asks_every_worker_and_tolerates_failures() -> None:
    links = [FakeLink("a:1"), FakeLink("b:1", fail=["close_run"]), FakeLink("c:1")]
    roster = Roster(links)
    roster.close_sessions("run-1", timeout=3.0)
    assert [link.calls for link in links] == [[("close_run", ("run-1", 3.0))]] * 3
