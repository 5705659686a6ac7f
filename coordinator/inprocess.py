"""Workers in this process: a ``WorkerClient`` stand-in that calls a ``WorkerEngine`` directly.

For simulations and benchmarks that want the service's exact logic without gRPC (``benchmarks.quality``
trains several methods side by side this way): the coordinator's ``Trainer`` and the worker's engine run
unchanged, and every message still goes through the protocol's serde both ways, so byte counts are those
of the serialized messages the wire would carry (without the gRPC framing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from google.protobuf.message import Message

from gradwire import protocol
from gradwire.coordinator.client import WorkerError
from gradwire.protocol import ModelState, RoundResult, WorkerInfo, WorkerState, WorkOrder
from gradwire.replica import Fingerprint
from gradwire.v1 import worker_pb2 as pb
from gradwire.worker.engine import WorkerEngine
from gradwire.worker.servicer import status_for

T = TypeVar("T")


class InProcessClient:
    """Quacks like ``coordinator.client.WorkerClient``; ``timeout`` arguments are accepted and ignored."""

    def __init__(self, engine: WorkerEngine, address: str = "in-process") -> None:
        self.engine = engine
        self.address = address
        self.last_bytes_down = 0  # coordinator -> worker
        self.last_bytes_up = 0  # worker -> coordinator
        self._cancelled = threading.Event()

    def wait_ready(self, timeout: float | None = None) -> None:
        return None

    def describe(self, timeout: float | None = None) -> WorkerInfo:
        return self.engine.info()

    def push_state(self, state: ModelState, timeout: float | None = None) -> tuple[int, Fingerprint]:
        down = protocol.state_to_proto(state)
        version, fingerprint = self.engine.push_state(protocol.state_from_proto(_wire(down, pb.ModelState)))
        self.last_bytes_down, self.last_bytes_up = down.ByteSize(), 0
        return version, fingerprint

    def run_round(self, order: WorkOrder, timeout: float | None = None) -> RoundResult:
        down = protocol.order_to_proto(order)
        self._cancelled.clear()
        try:
            result = self.engine.run_round(
                protocol.order_from_proto(_wire(down, pb.WorkOrder)), cancelled=self._cancelled.is_set
            )
        except Exception as e:
            status = status_for(e)  # as the servicer answers it; a bug (None) surfaces here as itself
            if status is None:
                raise
            raise WorkerError(self.address, *status) from None
        up = protocol.result_to_proto(result)
        self.last_bytes_down, self.last_bytes_up = down.ByteSize(), up.ByteSize()
        return protocol.result_from_proto(_wire(up, pb.RoundResult))

    def fetch_worker_state(self, run_id: str, timeout: float | None = None) -> WorkerState:
        up = protocol.worker_state_to_proto(self.engine.worker_state(run_id))
        self.last_bytes_down, self.last_bytes_up = 0, up.ByteSize()
        return protocol.worker_state_from_proto(_wire(up, pb.WorkerState))

    def cancel(self) -> None:
        self._cancelled.set()

    def close_run(self, run_id: str, timeout: float | None = None) -> bool:
        return self.engine.close_run(run_id)

    def close(self) -> None:
        return None


def _wire(message: Message, cls: type[Message]) -> Message:
    """The message as the other side parses it: serialized and parsed again, as on the wire."""
    return protocol.parse(cls, message.SerializeToString())


def in_process_clients(
    n: int, device: str = "cpu", factory: Callable[[str], WorkerEngine] = WorkerEngine
) -> list[InProcessClient]:
    return [InProcessClient(factory(device), f"in-process-{i}") for i in range(n)]
