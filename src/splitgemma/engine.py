"""Python conveniences over the native engine (splitgemma._native.Model / KvArena / sample / RowSampler /
sample_rows / prompt_logprobs); see docs/engine-api.md.

The native objects are the API; this module only adds an arena constructor over (shared) memory and named results
for sample() and sample_rows().
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from splitgemma._native import KvArena, Model, RowSampler, prompt_logprobs
from splitgemma._native import sample as _native_sample
from splitgemma._native import sample_rows as _native_sample_rows

__all__ = ["KvArena", "Model", "RowSampler", "Sample", "open_arena", "prompt_logprobs", "sample", "sample_rows"]


def open_arena(model: Model, n_slots: int, path: str | os.PathLike | None = None) -> KvArena:
    """A KvArena of n_slots slots over fresh anonymous memory, or over the file at `path` mapped shared (e.g. under
    /dev/shm, so another process can open the same slots). The file is created or grown to the arena size; an
    existing file keeps its contents (slot headers say what each slot holds). The mapping lives as long as the
    arena."""
    if n_slots < 1:
        raise ValueError(f"n_slots must be at least 1, got {n_slots}")
    size = n_slots * model.kv_slot_bytes
    if path is None:
        return KvArena(model, advise_huge_pages(anonymous_memory(size)), n_slots)
    fd = os.open(os.fspath(path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return KvArena(model, advise_huge_pages(buf), n_slots)


def anonymous_memory(size: int) -> mmap.mmap:
    """size bytes of private anonymous memory. Not mmap.mmap(-1, size): that is MAP_SHARED, i.e. shared memory,
    which takes huge pages only under the host's shmem_enabled setting (often "never"), whatever it is advised."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def smaps() -> list[dict] | None:
    """This process's mappings from /proc/self/smaps, each as {"start", "end", "path", "fields" (name: kB), "flags"
    (its VmFlags)}, or None where there is no such file."""
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out: list[dict] = []
    for line in lines:
        head, _, rest = line.partition(" ")
        if head.endswith(":"):
            if head == "VmFlags:":
                out[-1]["flags"] = set(rest.split())
            else:
                out[-1]["fields"][head[:-1]] = int(rest.split()[0])
        else:  # "start-end perms offset dev inode [path]"
            lo, _, hi = head.partition("-")
            parts = line.split(maxsplit=5)
            out.append({"start": int(lo, 16), "end": int(hi, 16), "path": parts[5] if len(parts) > 5 else "",
                        "fields": {}, "flags": set()})
    return out


def huge_mapped_bytes(buf: mmap.mmap) -> int | None:
    """Bytes of buf's mapping this process maps with 2 MB pages now (AnonHugePages + ShmemPmdMapped + FilePmdMapped of
    its entry in /proc/self/smaps; pages not touched yet are not mapped), or None where smaps cannot tell."""
    import numpy as np
    at = np.frombuffer(buf, np.uint8, count=1).ctypes.data
    entry = next((m for m in smaps() or [] if m["start"] <= at < m["end"]), None)
    if entry is None:
        return None
    return 1024 * sum(entry["fields"].get(k, 0) for k in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"))


def advise_huge_pages(buf: mmap.mmap) -> mmap.mmap:
    """buf, advised MADV_HUGEPAGE: the pages it has not touched yet come as transparent huge pages where the kernel
    gives them (anonymous memory under THP "madvise", shared memory under shmem_enabled "advise", a file's pages read
    into the page cache through it as 2 MB folios; pages already there stay as they are). Decode reads the weights
    and every sequence's K/V each step: on a KVM guest each 4 KB page costs a page walk (docs/benchmarks.md, session
    23). A kernel without THP: unchanged."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf


@dataclass(frozen=True)
class Sample:
    token: int
    rng_state: int  # pass to the next call for this request
    logprob: float  # of `token` under the distribution it was drawn from
    top_logprobs: list[tuple[int, float]]  # best first


def sample(logits, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, rng_state: int = 0,
           n_logprobs: int = 0) -> Sample:
    """One token from a logits row (temperature 0 = greedy). Same rules as splitgemma._native.sample."""
    token, state, logprob, top = _native_sample(logits, temperature, top_k, top_p, rng_state, n_logprobs)
    return Sample(token, state, logprob, top)


def sample_rows(logits, samplers, masks=None, *, model=None, rows=None) -> list[Sample | str]:
    """The next token of each row of logits [B, V] (float32, C-contiguous, processed in place) with its RowSampler,
    or with rows (distinct indices into logits) of the rows named, samplers[b] for logits[rows[b]]; masks: None or one
    entry per sampled row (None, or the row's constraint bitmask as 32-bit words). A row that failed is its error
    message instead of a Sample. model: a Model whose threads share the rows out (the same tokens; a wide decode
    step's rows each scan the whole vocabulary). Same rules as splitgemma._native.sample_rows."""
    return [r if isinstance(r, str) else Sample(*r)
            for r in _native_sample_rows(logits, samplers, masks, model, rows)]
