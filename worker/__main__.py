"""``python -m gradwire.worker serve ...``: the same as the ``worker`` command."""

from gradwire.worker.cli import main

raise SystemExit(main())
