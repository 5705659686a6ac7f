"""``--rank-memory-gb``: a model whose state would not fit a rank is refused with the sizes, never run out of
memory mid-round; gradient-mode state at the push, the local-SGD rest at the first local-SGD round."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from gradwire.compression import CodecConfig
from gradwire.errors import TooLarge, status_for
from gradwire.link import WorkerError
from gradwire.models import build_from_spec, model_spec, spec_elements
from gradwire.optim.inner import InnerOptimizerConfig
from gradwire.optim.outer import UpdateRule
from gradwire.protocol import OK, LocalSteps, ModelState, WorkOrder
from gradwire.replica import Replica
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.inprocess import InProcessClient
from gradwire.worker.sizing import GB, HEADROOM, fits, state_bytes

SPEC = model_spec("gpt-tiny")
ELEMENTS = spec_elements(SPEC)


def test_state_bytes_per_parameter_in_each_mode() -> None:
    gradient = state_bytes(1000, momentum=False, local_sgd=False)
    assert gradient == {"replica": 4000, "gradients": 4000, "error feedback": 4000}
    local = state_bytes(1000, momentum=True, local_sgd=True)
    assert sum(local.values()) == 28 * 1000 and local["inner optimizer"] == 8000 and local["outer momentum"] == 4000


def test_fits_within_the_headroom_and_names_the_sizes_when_not() -> None:
    need = 12 * 10**9  # gradient-mode state of a 1B-parameter model, without momentum
    assert fits(10**9, None, momentum=False, local_sgd=False)[0]
    assert fits(10**9, int(need / HEADROOM) + 1, momentum=False, local_sgd=False)[0]
    ok, why = fits(10**9, int(need / HEADROOM) - GB, momentum=False, local_sgd=False)
    assert not ok
    assert "1,000,000,000 parameters" in why and f"{need / GB:.2f} GB of gradient-mode state" in why
    assert "replica 3.73 GB" in why and "80% of the rank's" in why
    assert "replica 2.3 MB" in fits(610_624, 1 << 20, momentum=False, local_sgd=False)[1]  # small models in MB
    assert not fits(10**9, 24 * GB, momentum=True, local_sgd=True)[0]  # 28 B a parameter: not on a 24 GB card
    assert status_for(TooLarge("x")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "x")


def _state() -> tuple[Replica, ModelState]:
    replica = Replica(build_from_spec(SPEC, seed=0), UpdateRule(optimizer="sgd"))
    params = {n: p.detach().clone() for n, p in replica.params.items()}
    return replica, ModelState("run", 0, json_spec(), params, replica.rule.to_json())


def json_spec() -> str:
    import json

    return json.dumps(SPEC)


def _order(replica: Replica, local: bool) -> WorkOrder:
    batch = np.random.default_rng(0).integers(0, 8192, (4, 17)).astype(np.uint16)
    steps = LocalSteps(2, InnerOptimizerConfig(), (1e-3, 1e-3)) if local else None
    return WorkOrder("run", 0, 0, batch, CodecConfig(), replica.fingerprint(), local_steps=steps)


def test_a_worker_refuses_what_does_not_fit_and_keeps_serving() -> None:
    replica, state = _state()
    gradient_mode = sum(state_bytes(ELEMENTS, momentum=False, local_sgd=False).values())
    local_sgd = sum(state_bytes(ELEMENTS, momentum=False, local_sgd=True).values())
    small = InProcessClient(WorkerEngine("cpu", rank_memory=int(gradient_mode / HEADROOM) - 1))
    with pytest.raises(WorkerError) as e:
        small.push_state(state)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{ELEMENTS:,} parameters" in e.value.details
    assert not small.engine.sessions  # nothing was kept
    # Room for gradient rounds, not for a local-SGD round's working copy and inner optimizer.
    between = InProcessClient(WorkerEngine("cpu", rank_memory=int(local_sgd / HEADROOM) - 1))
    between.push_state(state)
    result, _ = between.run_round(_order(replica, local=False))
    assert result.status == OK
    with pytest.raises(WorkerError) as e:
        between.run_round(_order(replica, local=True))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "local-SGD state" in e.value.details
    roomy = InProcessClient(WorkerEngine("cpu", rank_memory=int(local_sgd / HEADROOM) + 1))
    roomy.push_state(state)
    assert roomy.run_round(_order(replica, local=True))[0].status == OK


def test_the_flag_takes_positive_gigabytes(capsys: pytest.CaptureFixture) -> None:
    from gradwire.worker.cli import parse_args

    assert parse_args(["serve", "--port", "1", "--rank-memory-gb", "0.5"]).rank_memory_gb == 0.5
    assert parse_args(["serve", "--port", "1"]).rank_memory_gb is None
    for bad in ("0", "-1", "nan", "lots"):
        with pytest.raises(SystemExit):
            parse_args(["serve", "--port", "1", "--rank-memory-gb", bad])
        assert "--rank-memory-gb" in capsys.readouterr().err


def test_auto_picks_ddp_when_the_whole_model_fits_else_fsdp_else_refuses() -> None:
    from gradwire.worker.sizing import choose_node_mode

    whole = 24 * 10**6  # a 1M-parameter model's local-SGD state, without outer momentum
    assert choose_node_mode(10**6, 2, None, momentum=False)[0] == "ddp"  # no limit known (a CPU)
    assert choose_node_mode(10**6, 2, int(whole / HEADROOM) + 1, momentum=False)[0] == "ddp"
    mode, shard, why = choose_node_mode(10**6, 2, int(whole / HEADROOM) - 1, momentum=False)
    assert (mode, shard) == ("fsdp", "full") and "with a 1/2 share (11.4 MB) it does" in why
    mode, _, why = choose_node_mode(10**6, 2, int(whole / 2 / HEADROOM) - 1, momentum=False)
    assert mode is None and "1,000,000 parameters" in why and "11.4 MB a rank even sharded over 2 ranks" in why
    assert choose_node_mode(10**6, 4, int(whole / 2 / HEADROOM) - 1, momentum=False)[0] == "fsdp"  # more ranks


def test_auto_with_zero1_counts_the_whole_model_and_a_share_of_the_inner_state() -> None:
    from gradwire.worker.sizing import choose_node_mode

    whole = 24 * 10**6  # 1M parameters: 16 B of replica, gradients, feedback and working copy, 8 of AdamW
    zero1 = 16 * 10**6 + 8 * 10**6 // 2  # each of 2 ranks: the whole model, half the inner state
    mode, shard, why = choose_node_mode(10**6, 2, int(zero1 / HEADROOM) + 1, momentum=False, shard="optimizer")
    assert (mode, shard) == ("fsdp", "optimizer") and "inner state split over 2 ranks (ZeRO-1) (19.1 MB)" in why
    # Where a 1/2 share of everything fits but ZeRO-1's share does not, ZeRO-1 refuses what ZeRO-3 takes.
    budget = int(whole / 2 / HEADROOM) + 1
    assert choose_node_mode(10**6, 2, budget, momentum=False)[0] == "fsdp"
    assert choose_node_mode(10**6, 2, budget, momentum=False, shard="optimizer")[0] is None
    parts = state_bytes(10**6, momentum=False, local_sgd=True, inner_shards=2)
    assert parts["inner optimizer"] == 4 * 10**6 and sum(parts.values()) == zero1


def test_auto_for_a_gossip_run_keeps_the_whole_model_on_every_rank() -> None:
    """A gossip run trains a model of the worker's own on every rank: auto picks DDP, else ZeRO-1 (whatever
    --node-shard says), never a split node; where neither fits it refuses and says why."""
    from gradwire.worker.sizing import choose_node_mode

    whole, zero1 = 24 * 10**6, 20 * 10**6  # 1M parameters, 2 ranks (as above)
    assert choose_node_mode(10**6, 2, None, momentum=False, whole_model=True)[:2] == ("ddp", "full")
    assert choose_node_mode(10**6, 2, int(whole / HEADROOM) + 1, momentum=False, whole_model=True)[0] == "ddp"
    mode, shard, why = choose_node_mode(10**6, 2, int(zero1 / HEADROOM) + 1, momentum=False, whole_model=True)
    assert (mode, shard) == ("fsdp", "optimizer") and "gossip rounds need the whole model on every rank" in why
    # A half share of everything fits (a plain run would be sharded), ZeRO-1's does not: refused.
    budget = int(whole / 2 / HEADROOM) + 1
    assert choose_node_mode(10**6, 2, budget, momentum=False)[:2] == ("fsdp", "full")
    mode, _, why = choose_node_mode(10**6, 2, budget, momentum=False, shard="full", whole_model=True)
    assert mode is None and "19.1 MB a rank even with its inner state split over 2 ranks (ZeRO-1)" in why
    assert "gossip rounds need the whole model on every rank" in why
