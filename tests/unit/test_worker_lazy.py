"""What only a sharded, ZeRO or pipelined node needs loads where one places a run, on a thread of its own."""

from __future__ import annotations

import importlib
import sys
import threading

import pytest

from gradwire.worker import lazy

from ..fresh import fresh_python


def test_the_node_modules_load_on_their_own_thread_once(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[tuple[str, threading.Thread]] = []
    real = importlib.import_module
    monkeypatch.setattr(lazy, "NODE_MODULES", ("colorsys", "wave"))  # two small modules, loaded anew here
    for name in lazy.NODE_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)

    def record(name: str, package: str | None = None):
        if name in lazy.NODE_MODULES:
            loaded.append((name, threading.current_thread()))
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", record)
    lazy.for_nodes()
    assert [name for name, _ in loaded] == ["colorsys", "wave"]
    assert all(thread is not threading.current_thread() for _, thread in loaded)
    lazy.for_nodes()  # loaded: nothing more to do
    assert len(loaded) == 2


def test_a_module_that_fails_to_load_fails_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lazy, "NODE_MODULES", ("gradwire.worker.no_such_module",))
    with pytest.raises(ModuleNotFoundError, match="no_such_module"):
        lazy.for_nodes()


def test_a_worker_and_its_round_modules_load_none_of_them() -> None:
    """In a fresh interpreter: what a single-device worker or a DDP node's rank imports to serve rounds."""
    code = (
        "import sys\n"
        "import gradwire.worker.engine, gradwire.worker.rounds, gradwire.worker.servicer\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.fsdp', *sys.argv[1:]) if m in sys.modules))\n"
    )
    assert fresh_python(code, *lazy.NODE_MODULES) == "[]"


def test_a_cpu_nodes_launcher_never_loads_torch() -> None:
    """``worker serve --device cpu --nproc-per-node 2`` only supervises: its ranks are forked from a server that
    loads torch once (``gradwire.processes``), so the launcher itself spends no second and no memory on it."""
    code = (
        "import sys\n"
        "import gradwire.worker.launch as launch\n"
        "seen = []\n"
        "launch.launch = lambda argv, nproc, **_: seen.append(nproc) or 0\n"
        "from gradwire.worker.cli import main\n"
        "code = main(['serve', '--port', '0', '--device', 'cpu', '--nproc-per-node', '2'])\n"
        "print(code, seen, 'torch' in sys.modules)\n"
    )
    assert fresh_python(code).split() == ["0", "[2]", "False"]
