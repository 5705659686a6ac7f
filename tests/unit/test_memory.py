"""keep_freed_memory: the codec's model-sized buffers are reused instead of being page-faulted in again."""

import subprocess
import sys

from gradwire.memory import keep_freed_memory

SCRIPT = """
import resource, sys, torch
from gradwire.compression import CodecConfig, ErrorFeedback, GradientCodec
from gradwire.memory import keep_freed_memory
took = keep_freed_memory() if sys.argv[1] == "keep" else False
shapes = {"w": (4096, 2048), "v": (2048, 4096)}  # 64 MB of float32 gradients: above glibc's mmap threshold
codec, feedback = GradientCodec(shapes, CodecConfig()), ErrorFeedback()
grads = {k: torch.randn(s) for k, s in shapes.items()}

def rounds(n):
    for _ in range(n):
        codec.decompress(codec.compress(grads, feedback))

# On a thread of its own, as in the worker (threads get their own malloc arenas unless told otherwise).
from concurrent.futures import ThreadPoolExecutor
thread = ThreadPoolExecutor(1)
thread.submit(rounds, 3).result()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
thread.submit(rounds, 3).result()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_codec_buffers_are_reused_not_refaulted():
    took, kept = _faults("keep")
    _, default = _faults("default")
    assert took == "True"
    # Three rounds re-fault hundreds of MB of fresh pages by default; kept memory was faulted in before.
    assert default > 50_000 and kept < default / 10, (kept, default)


def test_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("GRADWIRE_KEEP_MEMORY", "0")
    assert keep_freed_memory() is False
