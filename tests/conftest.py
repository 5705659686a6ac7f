"""Every test runs offline: no model or data-set hub is ever contacted (the hub clients read these at import).

And on one thread per process: the suite runs as several pytest processes (``-n``), and the worker, node and
coordinator processes that tests start inherit the setting, so no process's thread pool competes with the
others' for the same cores (a test that needs more threads asks for them)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402 - after the thread settings, which torch reads as it loads

torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list) -> None:
    """Slow tests first (stable otherwise). With ``--dist worksteal`` each process starts on its share of this
    order and one that runs out takes the last half of another's queue: the long tests start early and the
    many short ones fill in at the end, rather than one long test running alone last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
