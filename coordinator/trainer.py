"""The coordinator's round loop: dispatch, gather, validate, aggregate, step, keep replicas in sync.

One round (gradient mode):
  cut a batch per worker -> work order (token ids + the last round's update, never the state) ->
  workers replay the update, check the fingerprint, compute and compress their gradient ->
  validate every payload -> aggregate in the coefficient domain and step the replica -> the update rides
  on the next work order.
A worker that fails, times out or sends a bad payload spoils its own contribution to one round, not the
run; a worker that lost track of the state gets it pushed and carries on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch

from gradwire.compression import ErrorFeedback, PayloadError
from gradwire.compression.aggregate import Aggregator
from gradwire.coordinator.checkpoint import keep_last, load_checkpoint, save_checkpoint
from gradwire.coordinator.client import WorkerClient, WorkerError
from gradwire.coordinator.config import TrainConfig
from gradwire.coordinator.data import batch_dtype, open_data
from gradwire.coordinator.export import export_model
from gradwire.coordinator.metrics import MetricsLog, ProgressBar
from gradwire.coordinator.tracking import make_tracker
from gradwire.models import (
    build_from_spec,
    lm_loss,
    load_tokenizer_arg,
    resolve_model,
    tokenizer_vocab_size,
    vocab_size_of,
)
from gradwire.protocol import NEEDS_STATE, OK, ModelState, ProtocolError, RoundResult, WorkOrder
from gradwire.replica import Fingerprint, Replica, StateUpdate

log = logging.getLogger("gradwire.coordinator")

SyncAction = Literal["push", "replay", "current"]


def sync_action(known_version: int | None, base_version: int, target_version: int) -> tuple[SyncAction, str]:
    """What a worker needs before it computes at ``target_version``. Pure.

    ``base_version`` is where every in-sync worker starts the round; the pending update (if any) moves it
    to ``target_version``. ``known_version`` is the replica version we know the worker holds.
    """
    if known_version is None:
        return "push", "worker state unknown (new, failed or resumed)"
    if known_version == target_version:
        return "current", "worker is at the round's version"
    if known_version == base_version:
        return "replay", "worker replays the pending update"
    return "push", f"worker at version {known_version}, round starts at {base_version}"


@dataclasses.dataclass
class WorkerSlot:
    """A worker as the coordinator sees it. ``version`` is the replica version it is known to hold."""

    index: int
    client: WorkerClient
    version: int | None = None
    feedback: dict[str, torch.Tensor] | None = None  # error feedback to restore on the next push (resume)


@dataclasses.dataclass
class SlotOutcome:
    slot: WorkerSlot
    result: RoundResult | None
    error: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    pushes: int = 0  # state pushes during the round (a worker that reported NEEDS_STATE)


@dataclasses.dataclass
class _Push:
    error: str = ""
    bytes_down: int = 0


def max_sequence_length(spec: dict) -> int | None:
    """The longest sequence a model spec can take, when its config says."""
    config = spec.get("config", {})
    for key in ("max_seq_len", "max_position_embeddings", "n_positions"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


class Trainer:
    def __init__(self, config: TrainConfig, clients: Sequence[WorkerClient], *, progress: bool = True) -> None:
        if not clients:
            raise ValueError("--workers (or --local N) must name at least one worker")
        self.config = config
        # A resumed run takes its weights from the checkpoint: no need to load (or have) pretrained ones.
        resolved = resolve_model(config.model, from_scratch=config.from_scratch or bool(config.resume_from), seed=config.seed)
        self.spec = resolved.spec
        self.rule = config.update_rule()
        self.codec_config = config.codec_config()
        self.model = resolved.model
        self.names = [n for n, _ in self.model.named_parameters()]
        if self.rule.replayable:
            # The outer step is replayed from the aggregate: the model itself is the replica.
            self.replica = Replica(self.model, self.rule)
            self.optimizer = None
            self.delta_feedback = None
        else:
            # The outer step has state of its own: workers hold a shadow that follows compressed deltas.
            shadow = build_from_spec(self.spec, seed=config.seed)
            shadow.load_state_dict(self.model.state_dict())  # the same (possibly pretrained) start
            self.replica = Replica(shadow, self.rule)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate, betas=self.rule.betas, eps=self.rule.eps, weight_decay=self.rule.weight_decay)
            self.delta_feedback = ErrorFeedback(beta=1.0)
        self.codec = self.replica.codec(self.codec_config)
        tokenizer_name = config.tokenizer or resolved.default_tokenizer
        if tokenizer_name is None:
            raise ValueError(f"--model {config.model} has no tokenizer of its own: pass --tokenizer (e.g. gpt2 for GPT-2-vocabulary models)")
        self.tokenizer = load_tokenizer_arg(tokenizer_name)
        if tokenizer_vocab_size(self.tokenizer) > vocab_size_of(self.spec):
            raise ValueError(f"--tokenizer {tokenizer_name} has {tokenizer_vocab_size(self.tokenizer)} tokens; --model {config.model} embeds only {vocab_size_of(self.spec)}")
        self.data = open_data(
            paths=config.data, tokenizer=self.tokenizer, seq_len=config.sequence_length, seed=config.seed,
            data_config=config.data_config, text_field=config.text_field, streaming=config.streaming,
            n_slots=len(clients), val_rows=config.eval_batches * config.batch_size,
        )
        self.batch_dtype = batch_dtype(vocab_size_of(self.spec))
        limit = max_sequence_length(self.spec)
        if limit is not None and config.sequence_length > limit:
            raise ValueError(f"--sequence-length {config.sequence_length} exceeds the {limit} positions of --model {config.model}")
        self.slots = [WorkerSlot(i, c) for i, c in enumerate(clients)]
        self.run_id = uuid.uuid4().hex
        self.step = 0
        self.total_tokens = 0
        # Workers in sync hold the replica at ``base_version``; ``pending`` moves it one version on. The
        # coordinator applies ``pending`` to its own replica while the workers compute (or earlier, on a
        # flush before a checkpoint), so its replica is at base_version or base_version + 1.
        self.pending: StateUpdate | None = None
        self._pending_aggregator: Aggregator | None = None  # the pending replay, already summed
        self.base_version = 0
        self.base_fingerprint: Fingerprint | None = None
        self.output_dir = Path(config.output_dir)
        self.checkpoint_dir = Path(config.checkpoint_dir) if config.checkpoint_dir else self.output_dir / "checkpoints"
        self.state_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.progress = progress
        self._pool = ThreadPoolExecutor(max_workers=len(self.slots), thread_name_prefix="dispatch")
        if config.resume_from:
            self.resume(config.resume_from)
        self.base_version = self.replica.version
        self.base_fingerprint = self.replica.fingerprint()

    # ------------------------------------------------------------------------------------------ rounds

    def connect(self) -> None:
        """Describe every worker; a protocol mismatch or an unreachable worker stops here, clearly."""
        for slot in self.slots:
            slot.client.wait_ready(self.config.connect_timeout)
            info = slot.client.describe()
            log.info("worker %d at %s: %s (%s), torch %s", slot.index, slot.client.address, info.device, info.device_name, info.torch_version)

    def run(self) -> list[dict]:
        """Train from ``self.step`` to ``config.steps``; returns the metrics records of this call."""
        self.connect()
        records = []
        log_path = MetricsLog(self.output_dir)
        bar = ProgressBar(self.config.steps, self.step, disable=not self.progress)
        tracker = make_tracker(self.config)  # None unless --wandb-project
        failed_in_a_row, exit_code = 0, 1
        try:
            while self.step < self.config.steps:
                record = self.train_step()
                if record is None:
                    failed_in_a_row += 1
                    if failed_in_a_row >= self.config.max_failed_rounds:
                        raise RuntimeError(f"{failed_in_a_row} rounds in a row with no usable worker; see the log for each worker's error")
                    continue
                failed_in_a_row = 0
                if self.config.eval_every and self.step % self.config.eval_every == 0:
                    record["eval_loss"] = self.evaluate()
                log_path.append(record)
                if tracker:
                    tracker.log(record, step=self.step)
                bar.update(record)
                records.append(record)
                every = self.config.checkpoint_every
                if every and self.step % every == 0 and self.step < self.config.steps:
                    self.save_checkpoint()
            self.save_checkpoint()
            self.save_final()
            exit_code = 0
        finally:
            if tracker:
                tracker.finish(exit_code=exit_code)
            bar.close()
            log_path.close()
        return records

    @property
    def target_version(self) -> int:
        """The version this round's gradients are computed at."""
        return self.base_version + (1 if self.pending is not None else 0)

    def flush(self) -> None:
        """Apply the pending update to the coordinator's replica now (before a checkpoint or the end)."""
        if self.pending is not None and self.replica.version == self.base_version:
            self._apply_pending()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss of the current model on the held-out batches (on the coordinator)."""
        self.flush()
        cfg = self.config
        was_training = self.model.training
        self.model.eval()
        try:
            batches = self.data.val_batches(cfg.batch_size, cfg.sequence_length, cfg.eval_batches)
            losses = [float(lm_loss(self.model, torch.from_numpy(b.astype("int64")))) for b in batches]
        finally:
            self.model.train(was_training)
        return sum(losses) / len(losses)

    def _apply_pending(self) -> None:
        assert self.pending is not None
        self.replica.apply(self.pending, self._pending_aggregator)
        self._pending_aggregator = None
        self._target_fingerprint = self.replica.fingerprint()

    def train_step(self) -> dict | None:
        """One round. Returns its metrics, or None when no worker produced a usable gradient."""
        cfg, step = self.config, self.step
        t0 = time.perf_counter()
        lr = cfg.lr_at(step)
        base, target = self.base_version, self.target_version
        if self.pending is None:
            self._target_fingerprint = self.base_fingerprint
        # Pushes first, from a replica nothing is writing to; then the round and, alongside it, our own
        # copy of the pending update.
        to_push = [s for s in self.slots if sync_action(s.version, base, target)[0] == "push"]
        pushed = dict(zip((s.index for s in to_push), self._pool.map(self._push, to_push)))
        applied = threading.Event()
        futures = [self._pool.submit(self._work, slot, step, pushed.get(slot.index), applied) for slot in self.slots]
        try:
            if self.replica.version == base and self.pending is not None:
                self._apply_pending()
        finally:
            applied.set()  # never leave a worker's retry waiting, whatever happened here
        outcomes = [f.result() for f in futures]
        t_gathered = time.perf_counter()

        usable: list[RoundResult] = []
        aggregator = self.codec.aggregator()
        for o in outcomes:
            if o.result is None:
                log.warning("step %d: worker %d (%s) failed: %s", step, o.slot.index, o.slot.client.address, o.error)
                o.slot.version = None
                continue
            try:
                decoded = self.codec.decode(o.result.gradient)  # validate before anything is aggregated
            except PayloadError as e:
                log.warning("step %d: worker %d sent a bad payload, ignored: %s", step, o.slot.index, e)
                continue
            aggregator.add(decoded, float(o.result.tokens))
            usable.append(o.result)
            o.slot.version = o.result.version
        if not usable:
            return None

        payloads = tuple(r.gradient for r in usable)
        weights = tuple(float(r.tokens) for r in usable)
        grad_norm = self._next_update(payloads, weights, lr, aggregator)
        self.base_version, self.base_fingerprint = target, self._target_fingerprint
        self.step += 1
        t_done = time.perf_counter()

        tokens = sum(r.tokens for r in usable)
        self.total_tokens += tokens
        dense_bytes = 4 * self.codec.plan.numel * len(usable)
        step_time = t_done - t0
        return {
            "step": self.step,
            "loss": sum(r.loss * r.tokens for r in usable) / tokens,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens / step_time,
            "compression_ratio": dense_bytes / max(1, sum(p.nbytes for p in payloads)),
            "bytes_up": sum(o.bytes_up for o in outcomes),
            "bytes_down": sum(o.bytes_down for o in outcomes) + sum(p.bytes_down for p in pushed.values()),
            "step_time": step_time,
            "dispatch_time": t_gathered - t0,
            "aggregate_time": t_done - t_gathered,
            "successful_workers": len(usable),
            "total_tokens": self.total_tokens,
            "lr": lr,
            "pushes": sum(o.pushes for o in outcomes) + len(to_push),
            "worker_compute_time": max((r.timings.get("compute", 0.0) for r in usable), default=0.0),
            "worker_update_time": max((r.timings.get("update", 0.0) for r in usable), default=0.0),
            "worker_compress_time": max((r.timings.get("compress", 0.0) for r in usable), default=0.0),
        }

    def _next_update(self, payloads: tuple, weights: tuple, lr: float, aggregator: Aggregator) -> float:
        """Store the update this round's gradients make as ``pending``; return the aggregate's norm.

        ``aggregator`` already holds the validated payloads, summed in the coefficient domain.
        """
        if self.optimizer is None:
            # Replay: the update *is* the payloads; every replica aggregates them and steps alike. Ours
            # does so during the next round, from this same aggregator; the norm needs no inverse DCT.
            self.pending = StateUpdate(lr, payloads, weights)
            self._pending_aggregator = aggregator
            return aggregator.norm()
        aggregate = aggregator.result()
        for name, p in self.model.named_parameters():
            p.grad = aggregate[name].to(p.dtype)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        with torch.no_grad():
            delta = {n: p.detach() - self.replica.params[n] for n, p in self.model.named_parameters()}
        assert self.delta_feedback is not None
        self.pending = StateUpdate(lr, delta=self.codec.compress(delta, self.delta_feedback))
        self._pending_aggregator = None
        return aggregator.norm()

    def _work(self, slot: WorkerSlot, step: int, push: _Push | None, applied: threading.Event) -> SlotOutcome:
        """Everything one worker does this round; runs on the dispatch pool. Never raises."""
        outcome = SlotOutcome(slot, None)
        if push is not None and push.error:
            outcome.error = push.error
            return outcome
        batch = self.data.batch(step, slot.index, self.config.batch_size, self.config.sequence_length).astype(self.batch_dtype)
        target = self.target_version
        try:
            for attempt in range(2):
                if slot.version == self.base_version and self.pending is not None:
                    base, update, fingerprint = self.base_version, self.pending, self.base_fingerprint
                else:  # pushed at the round's version (a push after the pending update was applied)
                    applied.wait()
                    base, update, fingerprint = target, None, self._target_fingerprint
                assert fingerprint is not None
                order = WorkOrder(
                    self.run_id, step, base, batch, self.codec_config, fingerprint, update,
                    feedback_beta=self.config.feedback_beta, micro_batch_size=self.config.micro_batch_size,
                    sync_tolerance=self.config.sync_tolerance,
                )
                result = slot.client.run_round(order, timeout=self.config.round_timeout)
                outcome.bytes_down += slot.client.last_bytes_down
                outcome.bytes_up += slot.client.last_bytes_up
                if result.status == OK:
                    if result.round != step or result.version != target:
                        raise ProtocolError(f"result for round {result.round} at version {result.version}, expected {step} at {target}")
                    outcome.result = result
                    return outcome
                assert result.status == NEEDS_STATE
                log.info("step %d: worker %d needs the state (%s)", step, slot.index, result.reason)
                applied.wait()  # push the round's version, not one being written
                retry = self._push(slot)
                if retry.error:
                    raise WorkerError(slot.client.address, None, retry.error)
                outcome.pushes += 1
                outcome.bytes_down += retry.bytes_down
            outcome.error = "worker still out of sync after a state push"
        except (WorkerError, ValueError) as e:
            outcome.error = str(e)
        return outcome

    def _push(self, slot: WorkerSlot) -> _Push:
        """Send the replica's full state (at its current version) to a worker. Never raises."""
        state = self.model_state(feedback=slot.feedback or {})
        try:
            version, _ = slot.client.push_state(state, timeout=self.config.round_timeout)
        except WorkerError as e:
            slot.version = None
            return _Push(error=str(e))
        slot.feedback = None
        slot.version = version
        return _Push(bytes_down=slot.client.last_bytes_down)

    def model_state(self, feedback: dict[str, torch.Tensor] | None = None) -> ModelState:
        params = {n: p.detach() for n, p in self.replica.params.items()}
        momentum = {f"momentum.{i}": m for i, m in enumerate(self.replica.momentum)}
        return ModelState(self.run_id, self.replica.version, json.dumps(self.spec), params, self.rule.to_json(), momentum, feedback or {})

    # ------------------------------------------------------------------------------------------ persistence

    def save_checkpoint(self) -> Path:
        self.flush()
        tensors: dict[str, dict[str, torch.Tensor]] = {
            "model": {n: p.detach() for n, p in self.model.named_parameters()},
            "rng": {"torch": torch.get_rng_state()},
        }
        optimizer: dict[str, torch.Tensor] = {f"momentum.{i}": m for i, m in enumerate(self.replica.momentum)}
        if self.optimizer is not None:
            tensors["replica"] = {n: p.detach() for n, p in self.replica.params.items()}
            for name, p in self.model.named_parameters():
                for key, value in self.optimizer.state.get(p, {}).items():
                    optimizer[f"adamw.{name}.{key}"] = torch.as_tensor(value)
            assert self.delta_feedback is not None
            tensors["delta-feedback"] = self.delta_feedback.state_dict()
        tensors["optimizer"] = optimizer
        # Workers' error feedback is part of the trajectory: without it a resumed run would differ.
        futures = {slot.index: self._pool.submit(self._fetch_feedback, slot) for slot in self.slots}
        for index, future in futures.items():
            buffers = future.result()
            if buffers is not None:
                tensors[f"feedback-{index}"] = buffers
        meta = {"config": self.config.to_dict(), "version": self.replica.version, "total_tokens": self.total_tokens, "data_step": self.step, "workers": len(self.slots)}
        path = save_checkpoint(self.checkpoint_dir, self.step, tensors, meta)
        if self.config.keep_checkpoints:
            keep_last(self.checkpoint_dir, self.config.keep_checkpoints)
        return path

    def _fetch_feedback(self, slot: WorkerSlot) -> dict[str, torch.Tensor] | None:
        if slot.version is None:
            return slot.feedback
        try:
            return slot.client.fetch_feedback(self.run_id, timeout=self.config.round_timeout).buffers
        except WorkerError as e:
            log.warning("checkpoint: no error feedback from worker %d: %s", slot.index, e)
            return None

    def resume(self, path: str) -> None:
        tensors, meta = load_checkpoint(path)
        saved = meta["config"]
        if saved["model"] != self.config.model:
            raise ValueError(f"--resume-from holds a {saved['model']} run, not --model {self.config.model}")
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors["model"][name])
        optimizer = tensors.get("optimizer", {})
        momentum = [optimizer[f"momentum.{i}"] for i in range(sum(k.startswith("momentum.") for k in optimizer))]
        if self.optimizer is not None:
            self.replica.load_state(tensors["replica"], version=meta["version"])
            for name, p in self.model.named_parameters():
                state = {key.rsplit(".", 1)[-1]: v for key, v in optimizer.items() if key.startswith(f"adamw.{name}.") and key.count(".") == name.count(".") + 2}
                if state:
                    self.optimizer.state[p] = state
            assert self.delta_feedback is not None
            self.delta_feedback.load_state_dict(tensors.get("delta-feedback", {}))
        else:
            self.replica.load_state(tensors["model"], momentum, version=meta["version"])
        self.step = int(meta["step"])
        self.total_tokens = int(meta.get("total_tokens", 0))
        torch.set_rng_state(tensors["rng"]["torch"])
        for slot in self.slots:
            slot.feedback = tensors.get(f"feedback-{slot.index}")
            slot.version = None
        if meta.get("workers") != len(self.slots):
            log.warning("resuming %d-worker checkpoint with %d workers: error feedback restored by slot where it exists", meta.get("workers"), len(self.slots))
        log.info("resumed from %s at step %d", path, self.step)

    def save_final(self) -> Path:
        """The trained model and its tokenizer in <output_dir>/final (``export.load_exported`` reads it)."""
        self.flush()
        return export_model(self.model, self.spec, self.output_dir / "final", tokenizer=self.tokenizer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
