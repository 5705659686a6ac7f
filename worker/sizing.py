"""What a run's state takes on one rank, and whether a model fits there (``worker serve --rank-memory-gb``).

A worker (or each rank of a DDP or local-SGD node) holds, per parameter, in float32: the replica, the
outer momentum where the update rule has one, the gradients and the error feedback; local-SGD rounds add
a working copy and the inner optimizer's state (AdamW: two moments). That is 16 to 28 bytes a parameter,
before activations. ``fits`` is the pure check: a model whose state would take more than ``HEADROOM`` of
the rank's memory is refused with the sizes, at the state push (gradient-mode state) or at its first
local-SGD round (the rest), instead of running out of memory mid-round.
"""

from __future__ import annotations

import os

import torch

GB = 1 << 30
HEADROOM = 0.8  # the state may take this share of a rank's memory; activations and the codec need the rest

# (what, bytes per parameter), held in every round, and added by local-SGD rounds
GRADIENT_STATE = (("replica", 4), ("gradients", 4), ("error feedback", 4))
MOMENTUM = ("outer momentum", 4)
LOCAL_STATE = (("working copy", 4), ("inner optimizer", 8))


def state_bytes(elements: int, *, momentum: bool, local_sgd: bool, inner_shards: int = 1) -> dict[str, int]:
    """The bytes of each part of a run's state on one rank, for a model of ``elements`` parameters; the
    inner optimizer's split over ``inner_shards`` ranks (ZeRO-1: ``--node-shard optimizer``)."""
    parts = [*GRADIENT_STATE, *([MOMENTUM] if momentum else []), *(LOCAL_STATE if local_sgd else ())]
    out = {what: elements * per for what, per in parts}
    if "inner optimizer" in out:
        out["inner optimizer"] = -(-out["inner optimizer"] // inner_shards)
    return out


def fits(
    elements: int, budget: int | None, *, momentum: bool, local_sgd: bool, inner_shards: int = 1
) -> tuple[bool, str]:
    """Whether the state of a model of ``elements`` parameters fits a rank of ``budget`` bytes (``None``:
    no limit), and the sizes either way."""
    parts = state_bytes(elements, momentum=momentum, local_sgd=local_sgd, inner_shards=inner_shards)
    total = sum(parts.values())
    detail = ", ".join(f"{what} {size_text(size)}" for what, size in parts.items())
    if budget is None:
        return True, f"{size_text(total)} of state ({detail}); no memory limit"
    if total > HEADROOM * budget:
        return False, (
            f"a model of {elements:,} parameters needs {size_text(total)} of "
            f"{'local-SGD' if local_sgd else 'gradient-mode'} state per rank ({detail}), more than "
            f"{HEADROOM:.0%} of the rank's {size_text(budget)}"
        )
    return True, f"{size_text(total)} of state ({detail}) within {HEADROOM:.0%} of {size_text(budget)}"


def size_text(n: int) -> str:
    """Bytes as GB, or MB below one GB."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / (1 << 20):.1f} MB"


def device_memory(device: torch.device) -> int | None:
    """A CUDA device's memory in bytes; ``None`` elsewhere (a CPU's memory is the machine's to manage)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def free_device_memory(device: torch.device) -> int | None:
    """A CUDA device's free memory in bytes now; ``None`` elsewhere (as ``device_memory``)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def physical_memory() -> int:
    """This machine's memory in bytes (where the system does not say: 1 TiB, bounding nothing real)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def choose_node_mode(
    elements: int, ranks: int, budget: int | None, *, momentum: bool, shard: str = "full", whole_model: bool = False
) -> tuple[str | None, str, str]:
    """``--node-mode auto``: (mode, what an fsdp node shards, why). DDP when a whole model's local-SGD state
    fits a rank (the fastest: no parameter gathers), else FSDP when a rank's share of it does (1/ranks of
    it, or with ``shard`` "optimizer", ZeRO-1, the whole model with 1/ranks of the inner state), else
    ``None`` (refuse). ``whole_model`` (a gossip run, which needs every rank to hold the whole model) allows
    only DDP and ZeRO-1, whatever ``shard`` says. Pure; says why."""
    whole = sum(state_bytes(elements, momentum=momentum, local_sgd=True).values())
    if budget is None:
        return "ddp", "full", f"no memory limit on this device: every rank holds the whole model ({size_text(whole)})"
    room = HEADROOM * budget
    if whole <= room:
        return (
            "ddp",
            "full",
            f"the whole model's state ({size_text(whole)}) fits {HEADROOM:.0%} of a rank's {size_text(budget)}",
        )
    if whole_model:
        shard = "optimizer"
    if shard == "optimizer":
        share = sum(state_bytes(elements, momentum=momentum, local_sgd=True, inner_shards=ranks).values())
    else:
        share = -(-whole // ranks)
    what = f"its inner state split over {ranks} ranks (ZeRO-1)" if shard == "optimizer" else f"a 1/{ranks} share"
    gossip = "gossip rounds need the whole model on every rank; " if whole_model else ""
    if share <= room:
        return (
            "fsdp",
            shard,
            (
                f"the whole model's state ({size_text(whole)}) does not fit {HEADROOM:.0%} of a rank's "
                f"{size_text(budget)}; {gossip}with {what} ({size_text(share)}) it does: sharded"
            ),
        )
    return (
        None,
        shard,
        (
            f"a model of {elements:,} parameters needs {size_text(whole)} of state, {size_text(share)} a rank even "
            f"{'with ' + what if whole_model else f'sharded over {ranks} ranks'}: more than {HEADROOM:.0%} of a "
            f"rank's {size_text(budget)}"
            + (" (gossip rounds need the whole model on every rank)" if whole_model else "")
        ),
    )
