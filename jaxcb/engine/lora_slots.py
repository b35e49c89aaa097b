"""LoRA adapters on the host side: the request users name an adapter with (`LoRARequest`,
as vLLM's), and which adapter each of the device's slots holds (`LoraSlots`).

The device keeps `max_loras` adapters at once in fixed-size slot arrays (jaxcb/lora.py);
the engine knows any number (the runner keeps each one's weights on the host). A request
takes its adapter's slot when the scheduler admits it and gives it back when it stops
running (finished, aborted or preempted): the slot is pinned while a running request uses
it. An adapter not in a slot goes into an empty one, else into the one least recently
used by no running request; when every slot is pinned by other adapters, the request
waits in the queue (it does not fail) until one is released.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to generate with: `lora_name` (what the server's `model` field names),
    `lora_int_id` (>= 1, unique per adapter), `lora_path` (a PEFT adapter directory)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


class LoraSlots:
    """Which adapter (by lora_int_id) each device slot 1..num_slots holds, how many running
    requests pin it, and the order they were last released in (LRU)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._holder: list[int | None] = [None] * num_slots  # index: slot - 1
        self._pins = [0] * num_slots
        self._released_at = [0] * num_slots
        self._clock = itertools.count(1)
        self.num_loads = 0  # adapters written into a slot (the first time, or swapped in)

    def slot_of(self, lora_id: int) -> int:
        """The slot holding the adapter, 0 if none."""
        return self._holder.index(lora_id) + 1 if lora_id in self._holder else 0

    def acquire(self, lora_id: int) -> tuple[int, bool] | None:
        """Pin the adapter's slot for one more running request: (slot, whether the adapter
        must be written into it first); None when every slot is pinned by other adapters."""
        slot = self.slot_of(lora_id)
        if slot:
            self._pins[slot - 1] += 1
            return slot, False
        unpinned = [i for i in range(self.num_slots) if self._pins[i] == 0]
        if not unpinned:
            return None
        # an empty slot first, else the least recently released
        index = min(unpinned, key=lambda i: (self._holder[i] is not None, self._released_at[i]))
        self._holder[index] = lora_id
        self._pins[index] = 1
        self.num_loads += 1
        return index + 1, True

    def release(self, slot: int) -> None:
        """A running request of the adapter in `slot` stopped running."""
        if not 1 <= slot <= self.num_slots or self._pins[slot - 1] < 1:
            raise ValueError(f"LoRA slot {slot} is not pinned")
        self._pins[slot - 1] -= 1
        self._released_at[slot - 1] = next(self._clock)

    def forget(self, lora_id: int) -> None:
        """The adapter is unloaded: its slot (if any, and unpinned) becomes empty."""
        slot = self.slot_of(lora_id)
        if slot:
            if self._pins[slot - 1]:
                raise ValueError(f"LoRA adapter {lora_id} is in use by running requests")
            self._holder[slot - 1] = None

    @property
    def num_pinned(self) -> int:
        """Pins held, over all slots (0 once no request runs)."""
        return sum(self._pins)

    @property
    def loaded(self) -> list[int]:
        """The adapters in the slots."""
        return [h for h in self._holder if h is not None]
