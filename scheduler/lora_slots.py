"""Which LoRA adapter sits in which device slot: an LRU over `max_loras` slots.

The device holds adapters in slots 1..max_loras (slot 0 is "no adapter", always zeros). A
running request pins its adapter's slot; an adapter no running request uses stays resident
(a later request finds it there for free) until a new adapter needs its slot, the least
recently used going first. When every slot is pinned, a new adapter gets none and its
request waits in the queue. Each slot filled is reported once (`take_loads`), so the
engine copies that adapter's weights into the slot before the step that uses it runs.
"""

from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"{max_loras=} must be >= 1")
        self.max_loras = max_loras
        self._slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._users: dict[int, int] = {}  # adapter id -> running requests that pin it
        self._loads: list[tuple[int, int]] = []  # (slot, adapter id) filled since the last take_loads()

    def slot_of(self, lora_id: int) -> int:
        """The resident adapter's slot."""
        return self._slots[lora_id]

    def can_acquire(self, lora_id: int) -> bool:
        """The adapter is resident, or a slot is free or held by an adapter nobody runs."""
        return lora_id in self._slots or len(self._slots) < self.max_loras or self._evictable() is not None

    def acquire(self, lora_id: int) -> int | None:
        """Pin the adapter for one more running request; its slot, or None when all are pinned."""
        if lora_id not in self._slots:
            if len(self._slots) < self.max_loras:
                slot = min(set(range(1, self.max_loras + 1)) - set(self._slots.values()))
            else:
                victim = self._evictable()
                if victim is None:
                    return None
                slot = self._slots.pop(victim)
                self._users.pop(victim, None)
            self._slots[lora_id] = slot
            self._loads.append((slot, lora_id))
        self._slots.move_to_end(lora_id)
        self._users[lora_id] = self._users.get(lora_id, 0) + 1
        return self._slots[lora_id]

    def release(self, lora_id: int) -> None:
        """One running request of the adapter stopped running (finished or preempted)."""
        self._users[lora_id] -= 1

    def take_loads(self) -> list[tuple[int, int]]:
        """(slot, adapter id) of each slot filled since the last call: weights to copy in."""
        loads, self._loads = self._loads, []
        return loads

    @property
    def resident(self) -> dict[int, int]:
        """Adapter id -> slot of every adapter on the device."""
        return dict(self._slots)

    def _evictable(self) -> int | None:
        return next((i for i in self._slots if self._users.get(i, 0) == 0), None)

    def check_integrity(self) -> None:
        slots = list(self._slots.values())
        assert len(set(slots)) == len(slots) and all(1 <= s <= self.max_loras for s in slots)
        assert all(n >= 0 for n in self._users.values()), "an adapter released more often than acquired"
