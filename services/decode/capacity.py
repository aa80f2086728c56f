"""How many sequences the decode worker runs at once: its KV memory budget divided by the size of one KV slot.

A slot holds one sequence's K/V (Model.kv_slot_bytes: a function of the model, --max-context, --chunk and the K/V
type), and every slot of the arena can be in the decode batch, so the arena's size is the concurrency limit. The
operator gives the budget (--kv-cache-bytes) or the slot count itself (--slots); otherwise the budget is

    min(free space of the arena folder, (available RAM - the model file) / 2)

Why this rule: the arena lives in tmpfs, which is allocated in full at start and never swapped or reclaimed, so
it takes RAM away from everything else for the worker's whole life. The RAM it must not take is, first, the page
cache that holds the model's weights (decode reads all of them every step; an evicted page is a disk read), which
the kernel's MemAvailable counts as available; so the model file is subtracted. Half of what is left goes to the
arena, the other half stays for the prefill worker's and gateway's memory and for other tenants. Available RAM is
the tighter of /proc/meminfo's MemAvailable and the cgroup's memory.max − memory.current (in a container
/proc/meminfo shows the host). Inside a container with `shm_size`, the folder's free space is usually the bound.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from splitgemma.serving.shm_arena import ArenaError, free_bytes

# Left free in the arena folder: the owner record beside the arena (one tmpfs page) and other small files.
FOLDER_HEADROOM = 1 << 20
RAM_SHARE = 0.5


class CapacityError(ArenaError):
    """The KV budget cannot be met (holds no slot, more than the arena folder has): message only."""


@dataclass(frozen=True)
class Capacity:
    slots: int
    slot_bytes: int
    budget: int | None  # bytes; None when --slots fixed the count
    rule: str  # where the count comes from, for the start-up log

    @property
    def arena_bytes(self) -> int:
        return self.slots * self.slot_bytes

    def describe(self) -> str:
        """The start-up line a person reads."""
        return (f"KV cache: {self.slots} concurrent sequences × {_mib(self.slot_bytes)} per sequence = "
                f"{_mib(self.arena_bytes)} ({self.rule})")


def available_ram() -> int:
    """Bytes of RAM this process could still get: MemAvailable, or less under a cgroup v2 memory limit."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    avail = int(fields["MemAvailable"].split()[0]) * 1024
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
    except (OSError, ValueError):
        return avail
    return avail if limit == "max" else min(avail, max(0, int(limit) - used))


def default_budget(folder_free: int, ram: int, model_bytes: int) -> int:
    """The module rule, on the figures it reads (bytes)."""
    return max(0, min(folder_free - FOLDER_HEADROOM, int((ram - model_bytes) * RAM_SHARE)))


def plan(slot_bytes: int, *, slots: int | None, kv_cache_bytes: int | None, folder: str,
         model_path: str) -> Capacity:
    """The arena's slot count for slots of `slot_bytes`: `slots` as given, or the budget (given, or the module
    rule) // slot_bytes. Raises CapacityError when the budget holds no slot or exceeds the folder's free space."""
    if slots is not None:
        return Capacity(slots, slot_bytes, None, "--slots")
    if not os.path.isdir(folder):
        raise CapacityError(f"shared-memory directory {folder} does not exist")
    free = free_bytes(folder)
    if kv_cache_bytes is not None:
        if kv_cache_bytes > free:
            raise CapacityError(f"--kv-cache-bytes {kv_cache_bytes:,} exceeds the free space of {folder} "
                                f"({free:,} bytes free); give a smaller budget or more shared memory "
                                "(docker: --shm-size / compose: shm_size)")
        budget, rule = kv_cache_bytes, f"--kv-cache-bytes {kv_cache_bytes:,}"
    else:
        ram, model_bytes = available_ram(), os.path.getsize(model_path)
        budget = default_budget(free, ram, model_bytes)
        rule = (f"budget {budget:,} bytes = min({folder} free {free:,} - {FOLDER_HEADROOM:,}, "
                f"(available RAM {ram:,} - model {model_bytes:,}) × {RAM_SHARE})")
    n = budget // slot_bytes
    if n < 1:
        raise CapacityError(f"the KV budget ({rule}) holds no sequence: one KV slot takes {slot_bytes:,} bytes "
                            "(set by the model, --max-context, --chunk and --kv-dtype); give a larger "
                            "--kv-cache-bytes, a smaller --max-context, or --slots")
    return Capacity(n, slot_bytes, budget, rule)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
