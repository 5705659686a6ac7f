"""What a run saves and restores: ``RunCheckpointer`` (``save``, ``maybe_save``, ``restore``).

A checkpoint holds everything the run's trajectory depends on, so that a resumed run continues as if it
had not stopped: the model and the outer optimizer (``OuterStrategy.checkpoint``), the torch RNG, the
gather stage's memory of typical norms, where the data stream stood for every worker, and each worker's
error feedback and inner optimizer state, fetched from the workers in parallel, and how each worker has
stood (strikes, benching, agreement score, spot checks). The files themselves are written atomically by
``coordinator.checkpoint``.

A worker's state is saved under its address (``worker_key``); on resume, a worker at a new address (fresh
``--local`` workers) takes the state of the one that had its position.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from gradwire.coordinator.checkpoint import keep_last, load_checkpoint, save_checkpoint
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import TokenSource
from gradwire.coordinator.decisions import Score, Standing
from gradwire.coordinator.gather import Gatherer
from gradwire.coordinator.outer import OuterStrategy
from gradwire.coordinator.round import WorkerSlot
from gradwire.link import WorkerError

if TYPE_CHECKING:
    from gradwire.coordinator.work import WorkPlanner

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]
# What a run's own loop adds to a checkpoint, taken when it is saved: tensor groups, and JSON metadata.
Extra = Callable[[], tuple[dict[str, Tensors], dict]]


def worker_key(slot: WorkerSlot) -> str:
    """A worker's name in checkpoints: its address, as a tensor-group name (``w-127.0.0.1_50051``)."""
    return "w-" + re.sub(r"[^A-Za-z0-9_.-]", "_", slot.client.address)


@dataclasses.dataclass(frozen=True)
class RunPosition:
    """Where a run stands: the next round to train, and the tokens trained on so far."""

    step: int = 0
    total_tokens: int = 0


class RunCheckpointer:
    """Saves and restores one run's checkpoints in ``directory``."""

    def __init__(
        self,
        directory: Path,
        config: TrainConfig,
        outer: OuterStrategy,
        data: TokenSource,
        gather: Gatherer,
        pool: ThreadPoolExecutor,
        run_id: str,
        planner: WorkPlanner | None = None,
    ) -> None:
        """``planner``: its throughput estimates and shares (--balance) are saved and restored too."""
        self.directory = directory
        self.planner = planner
        self.config = config
        self.outer, self.data, self.gather = outer, data, gather
        self.pool = pool
        self.run_id = run_id
        # What ``restore`` loaded, for the owner of a checkpoint's ``Extra``: tensor groups, metadata.
        self.restored_extra: tuple[dict[str, Tensors], dict] = ({}, {})
        self.restored_run_id: str | None = None  # the run id ``restore`` loaded, if the checkpoint has one

    def maybe_save(self, position: RunPosition, slots: Sequence[WorkerSlot], extra: Extra | None = None) -> Path | None:
        """A checkpoint every ``--checkpoint-every`` steps, except at the last (the run's end saves that)."""
        every = self.config.checkpoint_every
        if every and position.step % every == 0 and position.step < self.config.steps:
            return self.save(position, slots, extra)
        return None

    def save(self, position: RunPosition, slots: Sequence[WorkerSlot], extra: Extra | None = None) -> Path:
        """``extra``: what the run's own loop keeps besides (gossip rounds: the public copies), tensor groups
        and JSON under ``meta["extra"]``; ``restore`` hands them back (``restored_extra``)."""
        if self.config.overlap and self.outer.pending is not None:
            # The next round computes before the update in flight: keep the replica there, and the update.
            groups, version = self.outer.checkpoint_behind(), self.outer.base_version
        else:
            applied = self.outer.applied_group()  # for a worker that has not taken it yet (a resume)
            self.outer.apply_pending()  # the checkpoint holds the model after the last round's update
            groups, version = {**self.outer.checkpoint(), **applied}, self.outer.replica.version
        tensors = {**groups, "rng": {"torch": torch.get_rng_state()}}
        if self.gather.norms:  # the clip's memory of typical norms: part of the trajectory too
            tensors["robust"] = {"norms": torch.tensor(list(self.gather.norms), dtype=torch.float64)}
        # The workers' error feedback and inner optimizer state are part of the trajectory: without them a
        # resumed run would differ.
        futures = {worker_key(slot): self.pool.submit(self._worker_state, slot) for slot in slots}
        for key, future in futures.items():
            feedback, inner, own = future.result()
            if feedback is not None:
                tensors[f"feedback-{key}"] = feedback
            if inner:
                tensors[f"inner-{key}"] = inner
            if own:
                tensors[f"gossip-model-{key}"] = own
        extra_groups, extra_meta = extra() if extra is not None else ({}, {})
        if clash := set(extra_groups) & set(tensors):
            raise ValueError(f"checkpoint: the run's own groups {sorted(clash)} clash with the checkpoint's")
        tensors.update(extra_groups)
        meta = {
            "config": self.config.to_dict(),
            "version": version,
            "run_id": self.run_id,
            "workers": len(slots),
            "extra": extra_meta,
            **self.position_meta(position, slots),
        }
        path = save_checkpoint(self.directory, position.step, tensors, meta)
        if self.config.keep_checkpoints:
            keep_last(self.directory, self.config.keep_checkpoints)
        return path

    def position_meta(self, position: RunPosition, slots: Sequence[WorkerSlot]) -> dict:
        """Where the run stands besides its tensors (JSON): tokens, where the data stream stood for every worker,
        how each worker has stood (strikes, benching, agreement score, spot checks: the judge's memory), and
        the balancing estimates the next rounds' shares are a function of."""
        meta = {
            "total_tokens": position.total_tokens,
            "data_step": position.step,
            "worker_keys": [worker_key(slot) for slot in slots],
            "data_layouts": [[first, start, list(rows)] for first, start, rows in self.data.layouts],
            "standings": {worker_key(slot): standing_state(slot) for slot in slots},
        }
        if self.planner is not None:
            meta["balance"] = self.planner.state(position.step, [slot.client.address for slot in slots])
        return meta

    def restore_position(self, meta: dict, slots: Sequence[WorkerSlot]) -> dict[int, str]:
        """What ``position_meta`` saved, into the data, the planner and ``slots``' standings; each slot's key in
        ``meta`` (a worker at a new address takes the key of the one that had its position, if that one is
        not in the run any more)."""
        if meta.get("data_layouts"):
            self.data.restore_layouts(meta["data_layouts"])  # where the stream stood, worker by worker
        if self.planner is not None and meta.get("balance"):
            self.planner.restore(meta["balance"], [slot.client.address for slot in slots])
        saved_keys = meta.get("worker_keys", [])
        present = {worker_key(slot) for slot in slots}
        keys = {}
        for position, slot in enumerate(slots):
            key = worker_key(slot)
            if key not in saved_keys and position < len(saved_keys) and saved_keys[position] not in present:
                key = saved_keys[position]
            keys[slot.index] = key
            if key in meta.get("standings", {}):
                restore_standing(slot, meta["standings"][key])
        return keys

    def restore(self, path: str | Path, slots: Sequence[WorkerSlot]) -> RunPosition:
        """Load ``path`` into the outer strategy, the RNG, the gather stage, the data and ``slots`` (whose
        state goes to their workers with the next push); the position to continue from."""
        tensors, meta = load_checkpoint(path)
        self.restored_extra = (tensors, meta.get("extra", {}))
        self.restored_run_id = meta.get("run_id")
        saved = meta["config"]
        if saved["model"] != self.config.model:
            raise ValueError(f"--resume-from holds a {saved['model']} run, not --model {self.config.model}")
        self.outer.restore(tensors, meta["version"])
        torch.set_rng_state(tensors["rng"]["torch"])
        self.gather.norms.extend(tensors.get("robust", {}).get("norms", torch.zeros(0)).tolist())
        keys = self.restore_position(meta, slots)
        for slot in slots:
            # A known worker whose state was not saved starts without any.
            key = keys[slot.index]
            slot.feedback = tensors.get(f"feedback-{key}", tensors.get(f"feedback-{slot.index}"))
            slot.inner_optimizer = tensors.get(f"inner-{key}", tensors.get(f"inner-{slot.index}"))
            slot.gossip_model = tensors.get(f"gossip-model-{key}")
            slot.version = None
        if meta.get("workers") != len(slots):
            log.warning(
                "resuming %d-worker checkpoint with %d workers: worker state restored by slot where it exists",
                meta.get("workers"),
                len(slots),
            )
        log.info("resumed from %s at step %d", path, int(meta["step"]))
        return RunPosition(int(meta["step"]), int(meta.get("total_tokens", 0)))

    def _worker_state(self, slot: WorkerSlot) -> tuple[Tensors | None, Tensors | None, Tensors | None]:
        """A worker's error feedback, inner optimizer state and (gossip rounds) own model."""
        if slot.version is None:  # not pushed since a resume: what the checkpoint gave is still current
            return slot.feedback, slot.inner_optimizer, slot.gossip_model
        try:
            state, _ = slot.client.fetch_worker_state(self.run_id, timeout=self.config.round_timeout)
        except WorkerError as e:
            log.warning("checkpoint: no error feedback or inner optimizer state from worker %d: %s", slot.index, e)
            return None, None, None
        return state.feedback, state.inner_optimizer, state.gossip_model


def standing_state(slot: WorkerSlot) -> dict:
    """What a checkpoint keeps of how ``slot``'s worker has stood (JSON)."""
    s = slot.standing
    return {
        "strikes": s.strikes,
        "until": s.until,
        "score": [s.score.value, s.score.rounds],
        "checks": list(slot.checks),
    }


def restore_standing(slot: WorkerSlot, saved: dict) -> None:
    """``slot``'s standing as ``standing_state`` saved it: a resumed run benches, scores and counts on."""
    value, rounds = saved.get("score", [0.0, 0])
    slot.standing = Standing(int(saved.get("strikes", 0)), int(saved.get("until", 0)), Score(float(value), int(rounds)))
    passed, failed = saved.get("checks", [0, 0])
    slot.checks = (int(passed), int(failed))
