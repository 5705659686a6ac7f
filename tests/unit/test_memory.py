"""keep_freed_memory: the codec's model-sized buffers are reused instead of being page-faulted in again."""

from gradwire.memory import keep_freed_memory

from ..fresh import fresh_python

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
thread.submit(rounds, MEASURED).result()
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


MEASURED = 6  # rounds counted, after 3 that fault the buffers in


def _faults(mode: str) -> tuple[str, int]:
    script = SCRIPT.replace("MEASURED", str(MEASURED))
    out = fresh_python(script, mode).split()
    return out[0], int(out[1])


def test_codec_buffers_are_reused_not_refaulted():
    took, kept = _faults("keep")
    _, default = _faults("default")
    assert took == "True"
    # By default every round re-faults its buffers: over 200 MB of fresh pages. Kept memory was faulted in
    # before; under other load the heap may still grow once by the buffers' 64 MB (a different allocation
    # order across torch's threads), which is not a round's re-fault.
    assert default > 100_000 and kept < default / 5, (kept, default)


def test_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("GRADWIRE_KEEP_MEMORY", "0")
    assert keep_freed_memory() is False


GIVE_BACK = """
import sys, torch
from gradwire.memory import give_back_freed_memory, keep_freed_memory

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

keep_freed_memory()
big = torch.ones(256 * 2**20 // 4)  # 256 MB, touched
del big
kept = rss_mb()
took = give_back_freed_memory()
after = rss_mb()
big = torch.ones(256 * 2**20 // 4)
del big
print(took, kept, after, rss_mb())
"""


def test_a_rank_that_must_save_memory_gives_freed_memory_back():
    out = fresh_python(GIVE_BACK)
    took, kept, after, again = out.split()
    assert took == "True"
    # Kept, 256 MB freed stay resident; given back, they leave at once, and so does the next 256 MB freed.
    assert float(kept) - float(after) > 200 and float(again) - float(after) < 50, out
