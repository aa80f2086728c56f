"""Streaming writer of FASTGEM1 (.fgm) files (fgm-format §1–§2).

Layout: magic ``FASTGEM1``, u32 header length, compact JSON header, zeros up to the body start
(2 MiB reserved for the header, so the body starts at byte 2,097,216), then the tensor blobs, each
64-byte aligned with zero gaps, the file ending exactly at the end of the last blob.

Every tensor is declared up front (:meth:`FgmWriter.plan`), which fixes all offsets; data is then
appended to any tensor in any order and in pieces (a q4g weight and its int8 twin are both produced
from the same row chunk). :meth:`FgmWriter.finish` checks that every byte of
every blob was written, then writes the header and, last of all, the magic.

The file is written under a temporary name in the destination directory and renamed into place
only on success, so an interrupted or failed run never leaves a file that looks valid at the
destination (and the temporary file itself has no magic until the very end).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import ConversionError

MAGIC = b"FASTGEM1"
HEADER_RESERVE = 1 << 21                       # bytes reserved for the header JSON
ALIGN = 64
BODY_START = -(-(12 + HEADER_RESERVE) // ALIGN) * ALIGN   # 2,097,216
ARCH = "gemma3n"  # fastgemma's (stale) label; readers ignore it, we keep it for byte compatibility

_ITEMSIZE = {"f32": 4.0, "f16": 2.0, "q8c": 1.0, "q8g": 1.0, "q8ga": 1.0, "q8r": 1.0, "q4g": 0.5, "q4r": 0.5}


def blob_nbytes(dtype: str, shape) -> int:
    """Stored size of a tensor: 4·numel (f32), 2·numel (f16), numel (int8), numel/2 (int4)."""
    numel = 1
    for d in shape:
        numel *= int(d)
    return int(numel * _ITEMSIZE[dtype])


def _umask() -> int:
    # Read it without os.umask(), which would change it process-wide for a moment.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def align_up(x: int, a: int = ALIGN) -> int:
    return -(-x // a) * a


@dataclass
class TensorEntry:
    """One tensor of the file: what the header says about it."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    meta: dict = field(default_factory=dict)
    offset: int = 0
    nbytes: int = 0

    def header(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, "meta": self.meta}


def plan_offsets(entries: list[TensorEntry]) -> int:
    """Assign each entry its nbytes and 64-aligned offset in order; returns the file size."""
    pos = BODY_START
    for e in entries:
        if e.dtype not in _ITEMSIZE:
            raise ValueError(f"{e.name}: unknown dtype {e.dtype}")
        e.nbytes = blob_nbytes(e.dtype, e.shape)
        e.offset = align_up(pos)
        pos = e.offset + e.nbytes
    return pos


def header_bytes(config: dict, meta: dict, entries: list[TensorEntry]) -> bytes:
    """The compact UTF-8 JSON header: {arch, config, meta, tensors} with tensors in blob order."""
    doc = {"arch": ARCH, "config": config, "meta": meta, "tensors": {e.name: e.header() for e in entries}}
    return json.dumps(doc, separators=(",", ":")).encode()


class FgmWriter:
    """Write one .fgm file. Use as a context manager: an exception discards the partial file.

    >>> with FgmWriter(path) as w:
    ...     w.plan(entries)                 # all tensors, in file order
    ...     w.write("l0.q_proj", bytes_)    # appends to that tensor's blob
    ...     w.finish(config, meta)          # header, magic, rename into place
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.entries: list[TensorEntry] = []
        self._by_name: dict[str, TensorEntry] = {}
        self._written: dict[str, int] = {}
        self.size = 0
        self._fd: int | None = None
        self._tmp: Path | None = None
        self.on_write = None  # optional callable(nbytes), e.g. a progress bar's update

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> "FgmWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._fd is not None or self._tmp is not None:
            self.abort()

    def plan(self, entries: list[TensorEntry], config: dict | None = None) -> None:
        """Fix the layout and open the temporary output file.

        With ``config`` given, a header of that config and these tensors is sized now, so a model
        whose header cannot fit the 2 MiB reserve fails before any work is done.
        """
        if self.entries:
            raise RuntimeError("plan() called twice")
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate tensor names: {dup}")
        self.size = plan_offsets(entries)
        self.entries = entries
        self._by_name = {e.name: e for e in entries}
        self._written = {e.name: 0 for e in entries}
        if config is not None:
            # Leave room for the small file-level meta written at the end.
            need = len(header_bytes(config, {}, entries)) + 64 * 1024
            if need > HEADER_RESERVE:
                raise ConversionError(f"the .fgm header would need about {need} bytes; the format reserves "
                                      f"{HEADER_RESERVE} ({len(entries)} tensors)")
        parent = self.path.parent if str(self.path.parent) else Path(".")
        if self.path.is_dir():
            raise ConversionError(f"{self.path}: is a directory, not an output file name")
        if not parent.is_dir():
            raise ConversionError(f"{self.path}: output directory {parent} does not exist")
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".partial", dir=parent)
        self._fd, self._tmp = fd, Path(tmp)
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp's 0600 would survive the rename
        # Size the file now: the header area, padding gaps and unwritten regions read as zeros.
        os.ftruncate(fd, self.size)

    @property
    def payload_bytes(self) -> int:
        """Total bytes of all blobs (what write() calls add up to)."""
        return sum(e.nbytes for e in self.entries)

    def write(self, name: str, data) -> None:
        """Append bytes to tensor ``name``'s blob (after what was written to it so far).
        ``data`` is bytes or a numpy array (its raw little-endian bytes)."""
        e = self._by_name[name]
        buf = memoryview(np.ascontiguousarray(data)).cast("B") if isinstance(data, np.ndarray) \
            else memoryview(data).cast("B")
        pos = self._written[name]
        if pos + len(buf) > e.nbytes:
            raise ValueError(f"{name}: write of {len(buf)} bytes at {pos} overflows its {e.nbytes}-byte blob")
        off, total = e.offset + pos, len(buf)
        while len(buf):
            n = os.pwrite(self._fd, buf, off)
            buf, off = buf[n:], off + n
            self._written[name] += n
        if self.on_write is not None:
            self.on_write(total)

    def finish(self, config: dict, meta: dict) -> None:
        """Check completeness, write the header and then the magic, and move the file into place."""
        short = [f"{n}: {w} of {self._by_name[n].nbytes} bytes" for n, w in self._written.items()
                 if w != self._by_name[n].nbytes]
        if short:
            raise RuntimeError("internal error: tensors not completely written: " + "; ".join(short[:10]))
        header = header_bytes(config, meta, self.entries)
        if len(header) > HEADER_RESERVE:
            raise ConversionError(f"the .fgm header is {len(header)} bytes; the format reserves {HEADER_RESERVE}")
        fd = self._fd
        # Blobs durable first, then the header, then the magic: at no point does a file with a
        # valid magic describe data that is not there.
        os.fsync(fd)
        os.pwrite(fd, len(header).to_bytes(4, "little") + header, 8)
        os.fsync(fd)
        os.pwrite(fd, MAGIC, 0)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            # Drop the written pages from the page cache: the write path caches them as 4 KiB pages, and a mapping
            # of cached pages stays 4 KiB-mapped until they are evicted, while the engine's first read faults them
            # back in as large folios, mapped 2 MiB at a time where the kernel does that (ext4 on Linux 6.18 here):
            # E2B decode B=1 ran ~4% faster from such a page cache (docs/benchmarks.md), for one read of the file.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        self._fd = None
        os.replace(self._tmp, self.path)
        self._tmp = None

    def abort(self) -> None:
        """Close and delete the temporary file (nothing appears at the destination)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            try:
                self._tmp.unlink()
            except FileNotFoundError:
                pass
            self._tmp = None
