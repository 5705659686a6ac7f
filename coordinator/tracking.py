"""Experiment tracking: the per-step metrics records, sent to Weights & Biases under the seed's metric names.

``make_tracker(config)`` returns ``None`` unless ``--wandb-project`` is set. Without an API key the run is
logged offline under ``<output_dir>/wandb/offline-run-*`` (upload it later with ``wandb sync``); a
``WANDB_MODE`` the user set always wins. Tracking must never stop training: the first wandb error is logged
as a warning and the tracker turns itself off. wandb is imported only when a tracker is made.
"""

from __future__ import annotations

import logging
import netrc
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from gradwire.coordinator.config import TrainConfig

__all__ = ["METRIC_NAMES", "Tracker", "WandbTracker", "make_tracker", "metric_name", "wandb_mode"]

log = logging.getLogger(__name__)

# Our record keys (see metrics.METRIC_KEYS) -> the names the seed's dashboards use.
METRIC_NAMES = {
    "loss": "train/loss",
    "grad_norm": "train/gradient_norm",
    "tokens_per_sec": "train/tokens_per_sec",
    "compression_ratio": "train/compression_ratio",
    "step_time": "train/step_time",
    "dispatch_time": "train/dispatch_time",
    "aggregate_time": "train/aggregate_time",
    "successful_workers": "train/successful_workers",
    "total_tokens": "train/total_tokens",
    "bytes_up": "train/bytes_up",
    "bytes_down": "train/bytes_down",
    "lr": "train/lr",
    "eval_loss": "eval/loss",
}
DEFAULT_BASE_URL = "https://api.wandb.ai"  # only for the fallback below; wandb itself knows its default


class Tracker(Protocol):
    def log(self, record: Mapping[str, Any], step: int) -> None: ...

    def finish(self, exit_code: int | None = None) -> None: ...


def metric_name(key: str) -> str:
    return METRIC_NAMES.get(key, f"train/{key}")


def _scalar(value: Any) -> float | int | None:
    # Numbers only: numpy scalars and 0-d tensors become Python numbers; bools, strings, lists are skipped.
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        value = item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _has_credentials() -> bool:
    """Whether wandb would find credentials: env, .netrc or its settings files. Never touches the network."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        # wandb >= 0.2x: the lookup wandb.init itself does (env, identity token, .netrc, settings file),
        # without prompting and without verifying the key against the server.
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        auth = wbauth.authenticate_session(
            host=settings.base_url, source="gradwire", prompt=False, update_session=False
        )
        return auth is not None
    except ImportError:  # an older wandb without wbauth: read .netrc the way it does
        pass
    except Exception as e:  # noqa: BLE001 - e.g. a malformed key in .netrc: warn, and log offline
        log.warning("wandb: could not read the configured credentials (%s); logging offline", e)
        return False
    return _netrc_has_key(os.environ.get("WANDB_BASE_URL", DEFAULT_BASE_URL))


def _netrc_has_key(base_url: str) -> bool:
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc").expanduser()
    try:
        creds = netrc.netrc(path).authenticators(urlsplit(base_url).netloc)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(creds and creds[2])


def wandb_mode() -> str | None:
    """The ``mode`` to pass to ``wandb.init``: ``None`` (wandb decides) if the user set ``WANDB_MODE`` or
    credentials are configured, else ``"offline"`` - wandb.init would otherwise fail asking for a key."""
    if os.environ.get("WANDB_MODE") or _has_credentials():
        return None
    return "offline"


class WandbTracker:
    """One wandb run for one training run. Every method is safe to call after a wandb failure."""

    def __init__(self, config: TrainConfig) -> None:
        self._run: Any = None
        self.mode: str | None = None
        try:
            import wandb

            output_dir = Path(config.output_dir)
            output_dir.mkdir(parents=True, exist_ok=True)  # wandb falls back to a temp dir if it is missing
            self.mode = wandb_mode()
            self._run = wandb.init(
                project=config.wandb_project,
                name=config.wandb_run_name,
                config=config.to_dict(),
                dir=str(output_dir),
                mode=self.mode,
            )
            if self.mode == "offline":
                log.info(
                    "wandb: no API key configured; logging offline under %s (upload with `wandb sync`)",
                    Path(self._run.dir).parent,
                )
        except Exception as e:  # noqa: BLE001 - tracking must not stop training
            self._disable(e, "start")

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, record: Mapping[str, Any], step: int) -> None:
        """Log one metrics record (``step`` excluded: it is the x axis) under the seed's names."""
        if self._run is None:
            return
        values = {}
        for key, value in record.items():
            number = _scalar(value)
            if key != "step" and number is not None:
                values[metric_name(key)] = number  # NaN/inf pass through: wandb charts them as gaps
        try:
            self._run.log(values, step=step)
        except Exception as e:  # noqa: BLE001
            self._disable(e, "log")

    def finish(self, exit_code: int | None = None) -> None:
        """End the run (``exit_code`` != 0 marks it failed). Idempotent."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            self._disable(e, "finish")

    def _disable(self, error: Exception, when: str) -> None:
        log.warning(
            "wandb failed to %s (%s: %s); tracking is off for the rest of this run", when, type(error).__name__, error
        )
        run, self._run = self._run, None
        if run is not None:
            try:
                run.finish(exit_code=1)
            except Exception:  # noqa: BLE001, S110 - already broken; the warning above says so
                pass


def make_tracker(config: TrainConfig) -> Tracker | None:
    """A wandb tracker if ``config.wandb_project`` is set, else ``None``."""
    if not config.wandb_project:
        return None
    return WandbTracker(config)
