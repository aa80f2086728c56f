"""The weights' mapping and the KV arena ask the kernel for transparent huge pages (MADV_HUGEPAGE): on a KVM guest
every 4 KB page a decode step streams costs a page walk (docs/benchmarks.md, session 23). The advice shows as "hg"
among the mapping's VmFlags in /proc/self/smaps, whatever the host's THP setting."""
from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
from conftest import fastgemma_fgm

from splitgemma import _native as N
from splitgemma.engine import advise_huge_pages, anonymous_memory, huge_mapped_bytes, smaps

pytestmark = pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage").is_dir() or not hasattr(mmap, "MADV_HUGEPAGE"),
    reason="this kernel has no transparent huge pages")


def test_the_weights_mapping_asks_for_huge_pages():
    path = str(fastgemma_fgm("mini-e2b-tame").resolve())
    model = N.Model(path)
    of_file = [m for m in smaps() if m["path"] == path]
    assert of_file, f"no mapping of {path} in /proc/self/smaps"
    assert all("hg" in m["flags"] for m in of_file), of_file
    del model


def test_advise_huge_pages_marks_the_mapping():
    buf = mmap.mmap(-1, 4 << 20)
    view = ctypes.c_char.from_buffer(buf)
    at = ctypes.addressof(view)
    del view

    def flags() -> set[str]:
        return next(m["flags"] for m in smaps() if m["start"] <= at < m["end"])

    assert "hg" not in flags()
    assert advise_huge_pages(buf) is buf
    assert "hg" in flags()
    buf.close()


def test_huge_mapped_bytes_counts_what_is_mapped_in_2mb_pages():
    small = anonymous_memory(1 << 20)  # cannot hold a 2 MB page
    small[:] = b"x" * len(small)
    assert huge_mapped_bytes(small) == 0
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this host")
    big = advise_huge_pages(anonymous_memory(16 << 20))
    assert huge_mapped_bytes(big) == 0  # nothing touched yet: nothing mapped
    big[:] = b"y" * len(big)
    assert 2 << 20 <= huge_mapped_bytes(big) <= 16 << 20
