"""The worker side: serves the gradwire.v1 Worker service, turns a work order into a compressed gradient.

Installed as ``gradwire.worker``. One of the two packages (with ``gradwire.coordinator``) that touches the
network; the codec it calls (``gradwire.compression``) stays pure.
"""
