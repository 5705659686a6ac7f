"""A top-k that starts high: the first steps of a run send more coefficients, the rest fewer, the same bytes.

Compression costs a gradient-mode run most at its start, where the gradient is large and turns fast and the
error feedback holds little yet: in ``benchmarks.quality`` (gpt-5m, 300 steps) the default codec ended its
first 30 steps 0.2 above dense AdamW in held-out loss and never caught up, while 4x the coefficients in
those steps alone brought the end to within 0.1% of dense. So the run's bytes are spent unevenly, as Deep
Gradient Compression's sparsity warm-up does: ``TopkWarmup`` keeps ``factor`` times the top-k for the first
steps and pays for them with a smaller top-k after, so that the whole run sends no more bits than the
configured top-k every step would (the bytes per trained token the top-k stands for stay what they were).

Pure: from the codec settings, the run's length and the warm-up's, the top-k of every step.
"""

from __future__ import annotations

import dataclasses

from gradwire.compression.config import CodecConfig
from gradwire.compression.packing import INDEX_BITS, ef_chunk_bits
from gradwire.compression.payload import ValueFormat
from gradwire.compression.plan import coded_format, value_bits

# At most this share of a run's steps is warm-up: the rest must pay for it in fewer coefficients.
MAX_WARMUP_SHARE = 0.1


def chunk_bits(config: CodecConfig, k: int) -> int:
    """Bits that ``k`` kept coefficients of a full ``chunk x chunk`` chunk cost on the wire: their indices
    in the settings' index coding and their values (a tensor's table and scales are the same at any k)."""
    area = config.chunk * config.chunk
    index = ef_chunk_bits(k, area) if config.indices == "elias-fano" else k * INDEX_BITS
    value = value_bits(coded_format(config) if config.quantized else ValueFormat.FLOAT32, config)
    return index + k * value


@dataclasses.dataclass(frozen=True)
class TopkWarmup:
    """The top-k of each step of a run: ``warm`` for the first ``steps``, ``rest`` after (``why`` says how
    they were chosen). ``steps`` 0: ``rest`` throughout, the configured top-k."""

    steps: int
    warm: int
    rest: int
    why: str

    @classmethod
    def plan(cls, config: CodecConfig, run_steps: int, warmup_steps: int, factor: float) -> TopkWarmup:
        """The warm-up for a run of ``run_steps`` steps with codec ``config``: ``factor`` times its top-k
        (at most a whole chunk) for ``warmup_steps`` steps (at most ``MAX_WARMUP_SHARE`` of the run), then
        the largest top-k that keeps the run's bits within those of ``config.topk`` at every step."""
        k, area = config.topk, config.chunk * config.chunk
        steps = min(warmup_steps, int(run_steps * MAX_WARMUP_SHARE))  # read here: a test may widen it
        warm = min(area, round(k * factor))
        if steps < 1 or warm <= k:
            return cls(0, k, k, "no top-k warm-up" if warmup_steps < 1 or warm <= k else "the run is too short")
        budget = run_steps * chunk_bits(config, k) - steps * chunk_bits(config, warm)
        rest = k
        while rest > 1 and (run_steps - steps) * chunk_bits(config, rest) > budget:
            rest -= 1
        return cls(
            steps,
            warm,
            rest,
            f"top-{warm} for the first {steps} of {run_steps} steps, then top-{rest}: the bits of top-{k} every step",
        )

    def topk_at(self, step: int) -> int:
        """The top-k of step ``step`` (0-based)."""
        return self.warm if step < self.steps else self.rest

    def config_at(self, config: CodecConfig, step: int) -> CodecConfig:
        """``config`` with the top-k of step ``step``."""
        k = self.topk_at(step)
        return config if k == config.topk else dataclasses.replace(config, topk=k)
