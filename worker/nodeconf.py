"""A node's configuration as its launcher sees it, before torch loads: the rank the environment gives this
process (torchrun's conventions: RANK, LOCAL_RANK, WORLD_SIZE) and the placement flags, checked.

``worker serve --nproc-per-node N`` only supervises its ranks (``worker.launch``); checking its flags here,
without torch, keeps that process small and quick to start, and refuses clashing flags before any rank
starts. ``worker.placement.Placement`` checks the same settings as each rank builds it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

NODE_MODES = ("ddp", "local-sgd", "fsdp", "pipeline")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")  # worker.pipeline's schedules, by name
# fsdp: what the ranks shard (ZeRO stages 1, 2 and 3), see Placement.shard
NODE_SHARDS = ("optimizer", "gradients", "full")
PRECISIONS = ("fp32", "bf16")
COMM_HOOKS = ("none", "fp16", "powersgd", "dct")  # worker.hooks' DDP communication hooks, by name


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Where this process stands in its node."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def rank_from_env(env: Mapping[str, str] | None = None) -> RankInfo | None:
    """The rank torchrun (or ``worker serve --nproc-per-node``) gave this process; None outside a node.

    A WORLD_SIZE of 1 is a node of one: the plain single-device worker.
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ValueError(f"RANK, LOCAL_RANK and WORLD_SIZE must be integers: {e}") from None
    if world < 1 or not 0 <= rank < world or not 0 <= local < world:
        raise ValueError(f"RANK {rank} and LOCAL_RANK {local} must lie in [0, WORLD_SIZE={world})")
    if world == 1:
        return None
    return RankInfo(rank, world, local)


def check_placement(
    mode: str, shard: str, sync_steps: int, comm_hook: str, precision: str, microbatches: int, schedule: str
) -> None:
    """A ``ValueError`` naming the flag, for placement settings that are unknown or clash."""
    if mode not in (*NODE_MODES, "auto"):
        raise ValueError(f"--node-mode must be auto or one of {', '.join(NODE_MODES)}, got {mode!r}")
    if shard not in NODE_SHARDS:
        raise ValueError(f"--node-shard must be one of {', '.join(NODE_SHARDS)}, got {shard!r}")
    if shard != "full" and mode not in ("fsdp", "auto"):
        raise ValueError(f"--node-shard {shard} applies to --node-mode fsdp (or auto, where it picks fsdp), not {mode}")
    if sync_steps < 0:
        raise ValueError(f"--node-sync-steps must be >= 0, got {sync_steps}")
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"--node-comm-hook must be one of {', '.join(COMM_HOOKS)}, got {comm_hook!r}")
    if precision not in (*PRECISIONS, "auto"):  # auto: resolved for the device (gradwire.hardware)
        raise ValueError(f"--precision must be auto or one of {', '.join(PRECISIONS)}, got {precision!r}")
    if microbatches < 0:
        raise ValueError(f"--pipeline-microbatches must be >= 0, got {microbatches}")
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"--pipeline-schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {schedule!r}")
