"""A model built on the meta device for its shapes alone: the same structure as any meta build, no values
computed, and no import of ``torch._dynamo`` (a second of CPU in every worker, on its first push)."""

from __future__ import annotations

import pytest
import torch

from gradwire.models import build_from_spec, model_spec, spec_elements
from gradwire.models.meta import no_meta_writes
from gradwire.worker.meta import parameters_on_meta

from ..fresh import fresh_python


def _layout(model: torch.nn.Module) -> tuple[list, list]:
    params = [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    buffers = [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]
    return params, buffers


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-10m"])
def test_skipping_the_writes_builds_the_layout_a_plain_meta_build_does(name: str) -> None:
    spec = model_spec(name)
    with torch.device("meta"):
        plain = build_from_spec(spec)
    with torch.device("meta"), no_meta_writes():
        skipped = build_from_spec(spec)
    assert _layout(skipped) == _layout(plain)
    assert spec_elements(spec) == sum(t.numel() for t in [*plain.parameters(), *plain.buffers()])
    real = build_from_spec(spec)  # the tied embedding stays tied: counted once
    assert _layout(real)[0] == _layout(plain)[0]


def test_only_value_writes_to_meta_tensors_are_skipped() -> None:
    torch.manual_seed(0)
    with no_meta_writes():
        real = torch.zeros(4).normal_()  # a real tensor's write still runs
        meta = torch.empty(2, 3, device="meta")
        assert meta.normal_() is meta and meta.fill_(1.0) is meta
        assert torch.nn.init.normal_(meta) is meta  # the initializers too, called by keyword inside torch
        assert meta.t_().shape == (3, 2)  # a shape is not a value: not skipped
        meta.requires_grad_()  # nor is autograd state
        assert meta.requires_grad
    assert bool((real != 0).any())


def test_counting_a_spec_and_laying_out_a_replica_import_no_dynamo() -> None:
    """In a fresh interpreter: what a worker does with a pushed spec before it allocates anything."""
    code = (
        "import sys\n"
        "from gradwire.models import build_from_spec, model_spec, spec_elements\n"
        "from gradwire.worker.meta import parameters_on_meta\n"
        "spec = model_spec('gpt-tiny')\n"
        "assert spec_elements(spec) > 0\n"
        "with parameters_on_meta():\n"
        "    model = build_from_spec(spec)\n"
        "assert all(p.is_meta for p in model.parameters())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert fresh_python(code) == "False"


def test_the_replicas_layout_keeps_real_rope_tables() -> None:
    with parameters_on_meta():
        model = build_from_spec(model_spec("gpt-tiny"))
    reference = build_from_spec(model_spec("gpt-tiny"))
    assert not model.rope_cos.is_meta and torch.equal(model.rope_cos, reference.rope_cos)
    assert torch.equal(model.rope_sin, reference.rope_sin)
