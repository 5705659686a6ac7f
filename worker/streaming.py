"""Gradient mode, streamed: each bucket of the payload compressed and sent while the backward goes on.

``BucketStream`` hooks the model's parameters for the round's last backward (``hooks``): as soon as every
gradient of a bucket (``compression.stream.buckets``, the last layers first, as a backward fills them) has
been accumulated, the bucket is compressed on the stream's own thread, with its own error feedback, and
handed to ``emit``, which frames it onto the RunRound response while the backward goes on. ``finish``
compresses the buckets no hook completed and returns the whole payload, the one a single codec sends.

Hooks fire only where the gradient the backward accumulates is the one sent: one device, no clipping (a
clip's scale needs the whole gradient's norm first). Elsewhere (a node's gradients after their
all-reduce, a gradient computed ahead, a clipped one) every bucket is compressed after the compute, in the
same pieces: the payload and the error feedback's layout are the same either way.

On a GPU the buckets are compressed on a CUDA stream of their own, each after an event recorded where the
backward produced its gradients: the codec's kernels run beside the backward's instead of queueing behind
them on the stream they share.

A round that fails after some buckets were compressed (cancelled, a NaN further on) has moved their error
feedback as a payload lost on the way would have; ``settle`` waits for them so that nothing writes to the
feedback once the round is over.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from gradwire.compression import CompressedGradient, ErrorFeedback
from gradwire.compression.shard import assemble
from gradwire.compression.stream import StreamPlan

Emit = Callable[[CompressedGradient], None]


class BucketStream:
    """One round's streamed payload: ``hooks`` around the last backward, then ``finish``."""

    def __init__(
        self, plan: StreamPlan, feedback: ErrorFeedback, emit: Emit | None, executor: ThreadPoolExecutor
    ) -> None:
        self.plan, self.feedback, self.emit, self.executor = plan, feedback, emit, executor
        self._bucket = {name: b for b, names in enumerate(plan.buckets) for name in names}
        self._left = [len(names) for names in plan.buckets]
        self._pieces: dict[int, Future[CompressedGradient]] = {}
        self._lock = threading.Lock()  # hooks of one backward may fire on several autograd threads
        device = plan.codec.device
        self._side = _side_stream(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def hooks(self, params: Mapping[str, torch.nn.Parameter]) -> Iterator[None]:
        """While inside: a parameter whose gradient the backward has finished counts towards its bucket, and
        a bucket whose gradients are all in is compressed and sent."""

        def ready(name: str) -> Callable[[torch.Tensor], None]:
            def hook(p: torch.Tensor) -> None:
                b = self._bucket[name]
                with self._lock:
                    self._left[b] -= 1
                    full = self._left[b] == 0
                if full:
                    self._send(b, {n: params[n].grad for n in self.plan.buckets[b]})

            return hook

        handles = [p.register_post_accumulate_grad_hook(ready(name)) for name, p in params.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def finish(self, grads: Mapping[str, torch.Tensor]) -> CompressedGradient:
        """Compress the buckets not sent yet, wait for every bucket, and return the whole payload. A bucket's
        ``NonFiniteInput`` is raised here (the round's error feedback has taken it in: reset it)."""
        for b in range(len(self.plan.buckets)):
            if b not in self._pieces:
                self._send(b, grads)
        try:
            pieces = [self._pieces[b].result() for b in range(len(self.plan.buckets))]
        finally:
            self.settle()
        return assemble(self.plan.codec.plan, pieces)

    def settle(self) -> None:
        """Wait until no bucket is being compressed (their errors are ``finish``'s to raise)."""
        for future in list(self._pieces.values()):
            with contextlib.suppress(Exception):
                future.result()

    def _send(self, b: int, grads: Mapping[str, torch.Tensor]) -> None:
        side, ready = self._side, None
        if side is not None:  # the gradients are done where the backward queued them: mark that point
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(side.device))

        def compress() -> CompressedGradient:
            if side is None:
                piece = self.plan.compress(b, grads, self.feedback)
            else:
                side.wait_event(ready)
                with torch.cuda.stream(side):
                    piece = self.plan.compress(b, grads, self.feedback)
                side.synchronize()  # the error feedback's update too, before any other stream reads it
            if self.emit is not None:
                self.emit(piece)
            return piece

        self._pieces[b] = self.executor.submit(compress)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The encode's own CUDA stream on ``device``, one per device and process (the encode thread is one)."""
    return _stream_on(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _stream_on(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index))
