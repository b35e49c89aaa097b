"""LoraSlots (engine/lora_slots.py): pinning, LRU swaps, waiting when every slot is pinned,
and LoRARequest's checks; and the scheduler admitting requests by their adapter's slot."""

from __future__ import annotations

import pytest

from jaxcb.engine.lora_slots import LoRARequest, LoraSlots


def test_an_adapter_shares_its_slot_and_loads_once():
    slots = LoraSlots(2)
    assert slots.acquire(7) == (1, True)
    assert slots.acquire(7) == (1, False)
    assert slots.num_pinned == 2 and slots.num_loads == 1
    slots.release(1)
    slots.release(1)
    assert slots.num_pinned == 0 and slots.loaded == [7]


def test_empty_slots_first_then_the_least_recently_released():
    slots = LoraSlots(2)
    assert slots.acquire(1) == (1, True)
    assert slots.acquire(2) == (2, True)
    assert slots.acquire(3) is None  # both pinned: the request waits
    slots.release(2)
    slots.release(1)  # slot 2 was released first: it goes
    assert slots.acquire(3) == (2, True)
    assert slots.slot_of(2) == 0 and slots.slot_of(1) == 1
    assert slots.acquire(1) == (1, False)  # still there: no load


def test_forget_and_bad_releases():
    slots = LoraSlots(1)
    slots.acquire(4)
    with pytest.raises(ValueError, match="in use"):
        slots.forget(4)
    slots.release(1)
    slots.forget(4)
    assert slots.loaded == []
    with pytest.raises(ValueError, match="not pinned"):
        slots.release(1)
    with pytest.raises(ValueError, match="max_loras"):
        LoraSlots(0)


@pytest.mark.parametrize(
    "args, message",
    [(("", 1, "p"), "lora_name"), (("a", 0, "p"), "lora_int_id"), (("a", 1, ""), "lora_path")],
)
def test_lora_request_checks(args, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args)
