"""Which LoRA adapters a step may run and where their weights sit: the scheduler's side of multi-LoRA (plain Python).

The runner holds `max_loras` slots of stacked adapter weights. Every running request's adapter must be in a slot,
so at most `max_loras` distinct adapters run at once: a waiting request whose adapter is not running and finds no
free slot waits. Adapters stay in their slot after their requests end (a later request of the same adapter costs no
copy); a new adapter takes a free slot, else the least recently used slot whose adapter no running request uses.

Fairness: a waiting request blocked by the adapter limit may be passed by later requests of adapters already
running (they take no slot), but only for `max_bypass_steps` steps; after that nothing is admitted past it, the
running adapters drain as their requests finish, and the blocked request takes the first slot that frees. Without
that cap a steady stream for the running adapters would starve every other adapter.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pagedserve.core.request import Request

# steps a waiting request may be passed over for the adapter limit before admission stops behind it
DEFAULT_MAX_BYPASS_STEPS = 8


class LoRASlots:
    def __init__(self, max_loras: int, max_bypass_steps: int = DEFAULT_MAX_BYPASS_STEPS) -> None:
        self.max_loras = max_loras
        self.max_bypass_steps = max_bypass_steps
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first

    @staticmethod
    def active_adapters(running: Iterable[Request]) -> set[int]:
        return {r.lora_request.lora_int_id for r in running if r.lora_request is not None}

    def admits(self, request: Request, active: set[int]) -> bool:
        """Whether `request` can run next to the adapters of the running requests (`active`)."""
        lora = request.lora_request
        return lora is None or lora.lora_int_id in active or len(active) < self.max_loras

    def may_bypass(self, blocked: Request) -> bool:
        """`blocked` could not be admitted for the adapter limit this step: may later requests be admitted past it?
        Counts the step against it."""
        blocked.lora_blocked_steps += 1
        return blocked.lora_blocked_steps <= self.max_bypass_steps

    def assign(self, active: set[int]) -> dict[int, int]:
        """Slots of the running adapters (at most max_loras of them): those in a slot keep it and become the most
        recently used; the others take a free slot or evict the least recently used inactive adapter."""
        if len(active) > self.max_loras:
            raise AssertionError(f"{len(active)} adapters running, {self.max_loras} slots")
        for adapter_id in active:
            if adapter_id in self.slot_of:
                self.slot_of.move_to_end(adapter_id)
        for adapter_id in sorted(active - self.slot_of.keys()):
            used = set(self.slot_of.values())
            if len(used) < self.max_loras:
                slot = min(set(range(self.max_loras)) - used)  # low slots first: fewer slots in the products
            else:
                victim = next(a for a in self.slot_of if a not in active)
                slot = self.slot_of.pop(victim)
            self.slot_of[adapter_id] = slot
        return {adapter_id: self.slot_of[adapter_id] for adapter_id in active}

    def remove(self, adapter_id: int) -> None:
        """An unloaded adapter gives its slot back (no running request may use it)."""
        self.slot_of.pop(adapter_id, None)
