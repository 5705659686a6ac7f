"""Code run in a fresh interpreter, for what only a new process shows: which modules an import or a command
loads."""

from __future__ import annotations

import subprocess
import sys


def fresh_python(code: str, *args: str) -> str:
    """Run ``python -c code args...``; its stdout, stripped. Fails the test, with its stderr, if it fails."""
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()
