"""The compiled core keeps its AVX-512 code where only AVX-512 CPUs reach it.

The AVX-512 and AMX kernels live in translation units compiled with those ISAs and are called only after CPUID said
yes; everything else (the Model, the AVX2 kernels, the bindings) must run on an AVX2-only CPU. A function defined in
one of those units but called on every backend, or an inline function whose out-of-line copy the linker takes from
one of them, breaks that: the AVX2 host dies with SIGILL (a Zen 3 host did, in the Model's constructor, on a scratch
sizing function compiled with -mavx512f). Only a CPU without AVX-512 would notice at run time, so this reads the
machine code instead, on any host: no exported function outside the AVX-512/AMX kernels may hold an EVEX-encoded
instruction (in 64-bit mode the byte 0x62 opening an instruction is always an EVEX prefix).
"""

import bisect
import re
import shutil
import subprocess

import pytest

import splitgemma._native as native

# The kernels whose names say they need AVX-512 (VNNI) or AMX: each is called only on the vnni or amx backend.
AVX512_ONLY = re.compile(r"avx512|amx|vnni|fma512")


def exported_functions(so):
    out = subprocess.run(["nm", "-D", "-S", "-C", "--defined-only", so], capture_output=True, text=True, check=True)
    funcs = []
    for line in out.stdout.splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[2] in "TtWw":
            funcs.append((int(parts[0], 16), int(parts[1], 16), parts[3]))
    return sorted(funcs)


def evex_counts(so):
    """{exported function: number of EVEX instructions within its own bytes}."""
    funcs = exported_functions(so)
    starts = [f[0] for f in funcs]
    dis = subprocess.run(["objdump", "-d", so], capture_output=True, text=True, check=True)
    counts = {}
    for m in re.finditer(r"^\s*([0-9a-f]+):\t62 ", dis.stdout, re.MULTILINE):
        addr = int(m.group(1), 16)
        i = bisect.bisect_right(starts, addr) - 1
        if i >= 0 and addr < funcs[i][0] + funcs[i][1]:
            counts[funcs[i][2]] = counts.get(funcs[i][2], 0) + 1
    return counts


@pytest.mark.skipif(not (shutil.which("nm") and shutil.which("objdump")), reason="needs binutils (nm, objdump)")
def test_avx512_instructions_stay_in_avx512_kernels():
    counts = evex_counts(native.__file__)
    # The scan sees the kernels that must hold AVX-512 code, so an empty result means a broken scan, not a clean one.
    assert any(name.startswith("sg::detail::gemm_vnni(") for name in counts), sorted(counts)
    leaked = sorted(name for name in counts if not AVX512_ONLY.search(name))
    assert not leaked, f"AVX-512 instructions in functions an AVX2-only CPU may call: {leaked}"
