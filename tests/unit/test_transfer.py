"""Host tensors to a device in one copy a dtype: the same tensors back, a copy a dtype, none where all are there."""

import torch

from gradwire.compression.transfer import joined, to_device

from ..hostreads import Calls


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(-8, 8, (5, 3), generator=g, dtype=torch.int8),
        torch.rand(3, generator=g),
        torch.randint(0, 4096, (2, 7), generator=g),
        torch.rand(0, generator=g),  # empty
        torch.randint(-8, 8, (3, 4), generator=g, dtype=torch.int8),
        torch.rand(4, 1, generator=g),
    ]


def test_joined_gives_every_tensor_back_with_its_shape_dtype_and_values_in_one_move_a_dtype() -> None:
    tensors, moves = _tensors(), []
    out = joined(tensors, lambda flat: moves.append(flat.dtype) or flat.clone())
    assert sorted(map(str, moves)) == sorted(map(str, {torch.int8, torch.float32, torch.int64}))
    for got, want in zip(out, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_to_a_device_copies_once_a_dtype_and_not_at_all_where_they_are() -> None:
    tensors = _tensors()
    with Calls({"to"}) as calls:
        same = to_device(tensors, "cpu")
    assert calls.names == [] and all(a is b for a, b in zip(same, tensors, strict=True))
    with Calls({"to"}) as calls:
        moved = to_device(tensors, "meta")  # another device (one without values): the copies are counted
    assert len(calls.names) == 3
    assert [(t.device.type, t.dtype, t.shape) for t in moved] == [("meta", t.dtype, t.shape) for t in tensors]
    mixed = [moved[0], *tensors[1:]]  # one there already: kept as it is, the others copied
    with Calls({"to"}) as calls:
        again = to_device(mixed, "meta")
    assert again[0] is moved[0] and len(calls.names) == 3
    assert [(t.device.type, t.dtype, t.shape) for t in again] == [("meta", t.dtype, t.shape) for t in tensors]
