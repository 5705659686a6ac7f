"""FSDP2 over a node's ranks (gloo, CPU, real processes): a sharded GPT computes the whole batch's gradient,
and each rank holds only its share of the parameters and gradients."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
        result = {
            "params": dict(fsdp.gathered(model)),
            "grads": dict(fsdp.gathered(model, "grad")),
            "param_bytes": fsdp.local_bytes(model),
            "grad_bytes": fsdp.local_bytes(model, "grad"),
        }
        torch.save(result, f"{out}.{rank}")
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
        torch.save({"params": dict(fsdp.gathered(working)), "state_bytes": _state_bytes(optimizer)}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def _state_bytes(optimizer: InnerOptimizer) -> int:
    return sum(
        (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()
        for o in optimizer._optimizers
        for state in o.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


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
        got = torch.load(f"{out}.{rank}")
        for name, p in model.named_parameters():
            torch.testing.assert_close(got["params"][name], p.detach(), rtol=1e-4, atol=1e-5)
        assert got["state_bytes"] <= whole_state / world * 1.05  # each rank: its shard's two moments


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
        got = torch.load(f"{out}.{rank}")
        for name, p in full.items():
            assert torch.equal(got["params"][name], p.detach()), name
            torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-6)
        # Dim-0 shards, padded to equal rows: a rank holds its 1/N plus at most a row of every tensor.
        slack = sum(p.element_size() * (p.numel() // p.shape[0]) for p in full.values())
        assert got["param_bytes"] <= full_bytes / world + slack and got["grad_bytes"] <= full_bytes / world + slack


def test_blocks_are_the_outermost_lists_children() -> None:
    model = build_from_spec(SPEC, seed=0)
    assert fsdp.blocks(model) == list(model.blocks)
    nested = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2)]))])
    assert fsdp.blocks(torch.nn.Sequential(nested)) == [nested[0]]
