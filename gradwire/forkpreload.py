"""Imported by the fork server that forks workers and ranks (``processes.worker_process``) as it starts:
what every worker imports first, loaded once. The server ends with its parent: it ignores SIGTERM (a
``killpg`` of the parent's group must reach the workers through the parent alone) and is killed when the
parent goes, which sends each worker SIGTERM in turn (the workers hold the server's liveness pipe open, so
its own check for the parent's exit would wait for them)."""

import signal

import torch  # noqa: F401 - the point: the forked workers find it imported

from gradwire.processes import die_with_parent

signal.signal(signal.SIGTERM, signal.SIG_IGN)
die_with_parent(signal.SIGKILL)
