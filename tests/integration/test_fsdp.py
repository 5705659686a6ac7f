"""FSDP2 over a node's ranks (gloo, CPU, real processes): a sharded GPT computes the whole batch's gradient,
and each rank holds only its share of the parameters and gradients."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.shard import Job, measure
from gradwire.models import build_from_spec, lm_loss, model_spec
from gradwire.optim.inner import InnerOptimizer, InnerOptimizerConfig
from gradwire.worker import fsdp

SPEC = model_spec("gpt-tiny")


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 8192, (8, 17)).astype(np.int64))


def _rank(rank: int, world: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        reference = build_from_spec(SPEC, seed=0)
        model = build_from_spec(SPEC, seed=1)  # other weights: ``load`` must overwrite every shard
        fsdp.shard(model)
        fsdp.load(model, dict(reference.named_parameters()))
        rows = _batch()[rank * 8 // world : (rank + 1) * 8 // world]
        lm_loss(model, rows).backward()
        tensors = {
            **{f"params/{n}": t for n, t in fsdp.gathered(model)},
            **{f"grads/{n}": t for n, t in fsdp.gathered(model, "grad")},
        }
        counts = {"param_bytes": fsdp.local_bytes(model), "grad_bytes": fsdp.local_bytes(model, "grad")}
        _save(f"{out}.{rank}", tensors, counts)
    finally:
        dist.destroy_process_group()


def _local_rank(rank: int, world: int, store: str, out: str) -> None:
    """H AdamW inner steps on a sharded working copy (gradwire's inner optimizer over the shards)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        working = fsdp.shard(build_from_spec(SPEC, seed=0))
        optimizer = InnerOptimizer(working, InnerOptimizerConfig(name="adamw", weight_decay=0.1))
        for h in range(STEPS):
            rows = _batch(h)[rank * 8 // world : (rank + 1) * 8 // world]
            lm_loss(working, rows).backward()
            optimizer.step(1e-3)
            working.zero_grad()
        params = {f"params/{n}": t for n, t in fsdp.gathered(working)}
        _save(f"{out}.{rank}", params, {"state_bytes": _state_bytes(optimizer)})
    finally:
        dist.destroy_process_group()


def _state_bytes(optimizer: InnerOptimizer) -> int:
    """The bytes of the moments this rank holds (its shards; ``step`` counters aside)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in optimizer.state_tensors().values()]
    return sum(t.numel() * t.element_size() for t in local if t.dim() > 0)


def _save(path: str, tensors: dict[str, torch.Tensor], counts: dict[str, int]) -> None:
    """A rank's findings for the test process: tensors in safetensors, counts in its metadata (no pickles)."""
    save_file({k: t.contiguous() for k, t in tensors.items()}, path, metadata={"counts": json.dumps(counts)})


def _load(path: str) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """What ``_save`` wrote: tensors grouped by their prefix ("params", "grads"), and the counts."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(path, "pt") as f:
        for key in f.keys():
            group, _, name = key.partition("/")
            grouped.setdefault(group, {})[name] = f.get_tensor(key)
        counts = json.loads(f.metadata()["counts"])
    return grouped, counts


STEPS = 3


@pytest.mark.slow
def test_inner_steps_on_a_sharded_working_copy_are_the_whole_batch_steps(tmp_path: Path):
    world, out = 2, str(tmp_path / "rank")
    mp.start_processes(_local_rank, args=(world, str(tmp_path / "store"), out), nprocs=world, start_method="spawn")
    model = build_from_spec(SPEC, seed=0)
    optimizer = InnerOptimizer(model, InnerOptimizerConfig(name="adamw", weight_decay=0.1))
    for h in range(STEPS):
        lm_loss(model, _batch(h)).backward()
        optimizer.step(1e-3)
        model.zero_grad()
    whole_state = _state_bytes(optimizer)
    for rank in range(world):
        got, counts = _load(f"{out}.{rank}")
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-4, atol=1e-5)
        assert counts["state_bytes"] <= whole_state / world * 1.05  # each rank: its shard's two moments


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_gpt_computes_the_whole_batch_gradient_on_a_share_of_the_memory(tmp_path: Path, world: int):
    out = str(tmp_path / "rank")
    mp.start_processes(_rank, args=(world, str(tmp_path / "store"), out), nprocs=world, start_method="spawn")
    reference = build_from_spec(SPEC, seed=0)
    lm_loss(reference, _batch()).backward()
    full = {n: p for n, p in reference.named_parameters()}
    full_bytes = sum(p.numel() * p.element_size() for p in full.values())
    for rank in range(world):
        got, counts = _load(f"{out}.{rank}")
        for name, p in full.items():
            assert torch.equal(got["params"][name], p.detach()), name
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6)
        # Dim-0 shards, padded to equal rows: a rank holds its 1/N plus at most a row of every tensor.
        slack = sum(p.element_size() * (p.numel() // p.shape[0]) for p in full.values())
        limit = full_bytes / world + slack
        assert counts["param_bytes"] <= limit and counts["grad_bytes"] <= limit


def test_blocks_are_the_outermost_lists_children() -> None:
    model = build_from_spec(SPEC, seed=0)
    assert fsdp.blocks(model) == list(model.blocks)
    nested = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))])
    assert fsdp.blocks(torch.nn.Sequential(nested)) == [nested[0]]


@pytest.mark.slow
def test_each_rank_of_a_sharded_node_holds_its_share_of_a_runs_state(tmp_path: Path):
    """Replica (and outer momentum), working copy, inner AdamW moments and error feedback after a local-SGD
    round: each rank of a 2-rank sharded node holds half of what a rank of a DDP node holds, plus padding."""
    held = {}
    for mode in ("ddp", "fsdp"):
        job = Job("gpt-tiny", mode, 2, 1, 2, 4, 16, "cpu", str(tmp_path / f"store-{mode}"), str(tmp_path / mode))
        held[mode] = measure(job)["state_bytes_by_part"]  # the benchmark's own measurement (benchmarks.shard)
    ddp = held["ddp"][0]
    assert ddp["feedback"] > 0 and ddp["inner"] > 0  # the DDP node's rank 0 holds all of it
    params = build_from_spec(SPEC, seed=0).parameters()
    padding = 4 * sum(p.numel() // p.shape[0] for p in params)  # a row of every tensor
    for part in ("replica", "working", "inner"):  # rows of every tensor
        shares = [held["fsdp"][rank][part] for rank in range(2)]
        slack = 3 * padding if part in ("inner", "replica") else padding  # two moments / momentum padded too
        assert all(0 < share <= ddp[part] / 2 + slack for share in shares), (part, shares, ddp[part])
    # The feedback is split by whole tensors (compression.shard.owners): together the ranks hold all of it,
    # each at most half plus the largest tensor (gpt-tiny's tied embedding is most of the model).
    feedback = [held["fsdp"][rank]["feedback"] for rank in range(2)]
    largest = 4 * max(p.numel() for p in build_from_spec(SPEC, seed=0).parameters())
    assert sum(feedback) == ddp["feedback"] and all(0 < f <= ddp["feedback"] / 2 + largest for f in feedback)
