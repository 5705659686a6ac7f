"""Per-parameter learning rates: (parameter name, factor) pairs that cross the network, bounded and checked.

An outer update rule (``outer.UpdateRule``) and a worker's inner optimizer (``inner.InnerOptimizerConfig``)
both carry them: the parameters they name step at the learning rate times their factor (and decay at it),
every other at the learning rate. ``--embedding-lr-scale`` and ``--inner-embedding-lr-scale`` fill them
with the model's token embedding (``models.token_embedding_names``).
"""

from __future__ import annotations

from collections.abc import Collection

LrScales = tuple[tuple[str, float], ...]

# Bounds on the pairs a peer may send: how many, a name's characters, a factor.
MAX_LR_SCALES = 64
MAX_NAME_CHARS = 512
MAX_LR_SCALE = 1000.0


def check_lr_scales(scales: object, what: str) -> LrScales:
    """``scales`` as (name, float factor) pairs, or ``ValueError`` naming ``what`` carries them: at most
    ``MAX_LR_SCALES`` pairs, names of 1 to ``MAX_NAME_CHARS`` characters, none twice, factors in
    (0, ``MAX_LR_SCALE``]. Lists (from JSON) are taken for tuples."""
    if not isinstance(scales, (tuple, list)) or len(scales) > MAX_LR_SCALES:
        raise ValueError(f"{what} lr_scales must be a list of at most {MAX_LR_SCALES} (name, factor) pairs")
    pairs = []
    for pair in scales:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"{what} lr_scales must be (name, factor) pairs, got {pair!r}")
        name, factor = pair
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"{what} lr_scales: a name of 1-{MAX_NAME_CHARS} characters, got {name!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= MAX_LR_SCALE:
            raise ValueError(f"{what} lr_scales: {name}'s factor must be in (0, {MAX_LR_SCALE:g}]: {factor!r}")
        pairs.append((name, float(factor)))
    if len({name for name, _ in pairs}) < len(pairs):
        raise ValueError(f"{what} lr_scales names a parameter twice")
    return tuple(pairs)


def unknown_names(scales: LrScales, names: Collection[str]) -> list[str]:
    """The parameters ``scales`` names that are not among the model's ``names``, sorted."""
    return sorted(name for name, _ in scales if name not in names)
