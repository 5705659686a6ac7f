"""``benchmarks.scale`` at a tiny size: the coordinator's real rounds with simulated workers, its egress
direct and relayed (``--relay peers``), as the benchmark reports it."""

from __future__ import annotations

import pytest

from benchmarks.scale import run_case

WORKERS = 8


@pytest.mark.parametrize("downlink", ["replay", "compressed"])
def test_relayed_rounds_cut_the_coordinators_egress_to_the_fanout(downlink):
    direct = run_case("gpt-tiny", downlink, WORKERS, rounds=1, seed=0)
    relayed = run_case("gpt-tiny", downlink, WORKERS, rounds=1, seed=0, relay="peers")
    assert direct["bytes_pulled"] == 0 and relayed["bytes_pulled"] > 0
    if downlink == "replay":  # every order carried the 7 other payloads; relayed, none
        assert direct["egress_payloads"] > WORKERS * (WORKERS - 1)
        # relayed, the orders alone (batches, fingerprints, references): under two of gpt-tiny's payloads
        assert relayed["egress_payloads"] < 2
        pulls = WORKERS * (WORKERS - 1)
        assert relayed["bytes_pulled"] == pytest.approx(pulls * relayed["payload_wire_bytes"], rel=0.02)
    else:  # one aggregate to each worker; relayed, to --relay-fanout 2 of them
        aggregate = direct["egress_bytes"] / WORKERS
        assert relayed["egress_bytes"] < 2 * aggregate + WORKERS * 2_000
        assert relayed["bytes_pulled"] == pytest.approx((WORKERS - 2) * aggregate, rel=0.05)
