"""_transport.staging_views and copy_to_staging: where the cuda-ipc transport copies a bucket's gradients
in a staging slot, piece by piece, with CPU tensors standing for the slot (the transport's own copies run
in test_cuda on the GPU machine, test_buckets_larger_than_a_staging_slot among them); how many slots
there are (staging_slots)."""

from __future__ import annotations

import pytest
import torch

from trainstream._C import TrainstreamError
from trainstream._transport import (
    LARGE_GRADIENTS_BYTES,
    MAX_STAGING_SLOTS,
    STAGING_SLOTS,
    STAGING_SLOTS_LARGE,
    copy_to_staging,
    staging_slots,
    staging_views,
    transport_name,
)

SHAPES = [(3, 5), (7,), (), (4, 4), (2, 1, 3)]


def bucket(dtype: torch.dtype):
    """A bucket of SHAPES in `dtype`: its gradients and their places (index, byte offset, elements,
    dtype, shape), one after another as in the job's layout."""
    torch.manual_seed(0)
    grads = [torch.randn(shape).to(dtype) for shape in SHAPES]
    places, offset = [], 0
    for i, grad in enumerate(grads):
        places.append((i, offset, grad.numel(), dtype, grad.shape))
        offset += grad.numel() * dtype.itemsize
    return grads, places, offset


def stage(grads, places, size: int, slot_bytes: int) -> list[torch.Tensor]:
    """Each piece's slot after the transport's copy into it."""
    slots = []
    for start in range(0, size, slot_bytes):
        slot = torch.full((slot_bytes,), 0xAB, dtype=torch.uint8)
        copy_to_staging(staging_views(slot, start, min(start + slot_bytes, size), places), dict(enumerate(grads)))
        slots.append(slot[:min(slot_bytes, size - start)])
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_bytes", [8, 24, 64, 4096])
def test_the_pieces_hold_the_buckets_bytes_in_order(dtype, slot_bytes):
    grads, places, size = bucket(dtype)
    expected = torch.cat([grad.reshape(-1) for grad in grads]).view(torch.uint8)
    assert torch.equal(torch.cat(stage(grads, places, size, slot_bytes)), expected)


def test_a_parameter_inside_one_piece_is_copied_whole_in_its_shape():
    grads, places, size = bucket(torch.float32)
    views = staging_views(torch.empty(size, dtype=torch.uint8), 0, size, places)
    assert [(i, part, view.shape) for i, part, view in views] == [(i, None, grads[i].shape) for i in range(len(SHAPES))]


def test_a_parameter_split_between_pieces_is_copied_in_element_ranges():
    grads, places, _ = bucket(torch.float32)  # the first parameter: 15 elements, bytes 0-60
    first = staging_views(torch.empty(24, dtype=torch.uint8), 0, 24, places)
    second = staging_views(torch.empty(24, dtype=torch.uint8), 24, 48, places)
    assert [(i, part) for i, part, _ in first] == [(0, slice(0, 6))]
    assert [(i, part) for i, part, _ in second] == [(0, slice(6, 12))]


def test_a_parameter_without_a_gradient_leaves_its_bytes_alone():
    grads, places, size = bucket(torch.float32)
    slot = torch.full((size,), 0xAB, dtype=torch.uint8)
    copy_to_staging(staging_views(slot, 0, size, places), {i: g for i, g in enumerate(grads) if i != 1})
    second = slice(places[1][1], places[2][1])  # the (7,) parameter's bytes
    assert torch.equal(slot[second], torch.full((28,), 0xAB, dtype=torch.uint8))
    assert torch.equal(slot[:second.start], grads[0].reshape(-1).view(torch.uint8))


def test_the_staging_slots_are_the_default_for_the_gradients_unless_the_environment_names_them(monkeypatch):
    monkeypatch.delenv("TRAINSTREAM_STAGING_SLOTS", raising=False)
    assert staging_slots(500 << 20) == STAGING_SLOTS
    assert staging_slots(LARGE_GRADIENTS_BYTES) == STAGING_SLOTS
    assert staging_slots(LARGE_GRADIENTS_BYTES + 1) == STAGING_SLOTS_LARGE < STAGING_SLOTS
    monkeypatch.setenv("TRAINSTREAM_STAGING_SLOTS", "7")
    assert staging_slots(500 << 20) == staging_slots(8 << 30) == 7
    monkeypatch.setenv("TRAINSTREAM_STAGING_SLOTS", str(MAX_STAGING_SLOTS))
    assert staging_slots() == MAX_STAGING_SLOTS


@pytest.mark.parametrize("value", ["0", "-2", "abc", "2.5", "", str(MAX_STAGING_SLOTS + 1)])
def test_a_staging_slot_count_other_than_a_whole_number_from_1_to_64_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("TRAINSTREAM_STAGING_SLOTS", value)
    with pytest.raises(TrainstreamError, match=f"TRAINSTREAM_STAGING_SLOTS={value!r}: a whole number .* from 1 to 64"):
        staging_slots()


def test_a_bad_staging_slot_count_is_refused_before_the_job_is_attached(monkeypatch):
    """transport_name runs before the attach; no GPU is touched to name a CUDA device's transport."""
    monkeypatch.setenv("TRAINSTREAM_STAGING_SLOTS", "0")
    with pytest.raises(TrainstreamError, match="TRAINSTREAM_STAGING_SLOTS='0'"):
        transport_name(torch.device("cuda", 0))
    monkeypatch.setenv("TRAINSTREAM_TRANSPORT", "cuda-client-copy")  # which has no staging slots
    assert transport_name(torch.device("cuda", 0)) == "cuda-client-copy"
