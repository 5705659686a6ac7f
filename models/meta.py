"""Building a model on the meta device without computing values: shapes only.

On the meta device torch checks most operations with Python meta kernels, and the first of them to run
imports ``torch._dynamo``: about a second of CPU in every process that builds a model there (each worker
counts and lays out a run's model on its first push). A build there needs no values: an in-place write to a
meta tensor (an initializer, a fill, a scaling) returns the tensor it was given and changes nothing else, so
``no_meta_writes`` returns it without running the kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# In-place writes of values, never of shape, dtype or autograd state (not ``resize_``, ``t_``,
# ``requires_grad_``): on a meta tensor each returns the tensor itself.
VALUE_WRITES = frozenset(
    {
        "normal_",
        "uniform_",
        "trunc_normal_",
        "kaiming_uniform_",
        "kaiming_normal_",
        "xavier_uniform_",
        "xavier_normal_",
        "orthogonal_",
        "constant_",
        "ones_",
        "zeros_",
        "fill_",
        "zero_",
        "copy_",
        "add_",
        "sub_",
        "mul_",
        "div_",
        "clamp_",
        "exponential_",
        "random_",
        "bernoulli_",
    }
)


class _NoMetaWrites(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in VALUE_WRITES:
            target = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def no_meta_writes() -> TorchFunctionMode:
    """A context in which (on this thread) in-place writes of values to meta tensors do nothing."""
    return _NoMetaWrites()
