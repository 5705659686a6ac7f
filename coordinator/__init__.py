"""The coordinator side: sends work orders to workers, aggregates their compressed gradients, steps.

Installed as ``gradwire.coordinator``. One of the two packages (with ``gradwire.worker``) that touches the
network; its decisions (quorum, resync, aggregation policy) are pure functions tested without one.
"""
