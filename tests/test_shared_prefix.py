"""Decode over a shared prefix (Model.decode prefixes=, docs/engine-api.md "Shared prefixes"): a token names a prefix
slot and reads the K/V of positions [0, prefix_len) there instead of in its own slot. The rows that name one prefix
attend it together with the tile kernel (ops::attend_spans_avx512 on vnni/amx, attend_spans_avx2 on avx2; each K/V
tile read once per block of rows), their own positions apart, and the parts are merged.

Oracles: the float64 reference forward (tests/tools/reference_forward.py, itself checked against transformers) of
the tame fastgemma file; the plain decode of a slot that holds a copy of the prefix (itself checked against the
reference in test_engine.py). Invariants: a prefixed row's numbers do not depend on the rows beside it, on how a run
is split into steps, or on what its own slot holds below prefix_len."""
from __future__ import annotations

import numpy as np
import pytest
from test_engine import EXACT, KV_DTYPES, arena, cosines, long_reference, model, rand_prompt  # noqa: F401

PREFIX = 200  # of the 300-token reference prompt: the tame file's window is 16, its rings 24 rows at chunk 8


def test_matches_the_float64_reference(backend, long_reference, report):  # noqa: F811
    """Two sequences read the reference prompt's first 200 positions from one prefix slot and decode the other 100
    teacher-forced. Their own slots hold the K/V of an unrelated prompt below 200, which no row may read: the
    logits follow the reference as a plain decode's do (test_decode_past_the_window_matches_reference)."""
    prompt, want = long_reference
    m = model(weights="int4", chunk=8, backend=backend, max_batch=4)
    a = arena(m, 3)
    m.prefill(a, 2, prompt[:PREFIX])
    for s in (0, 1):
        m.prefill(a, s, rand_prompt(PREFIX, seed=40 + s))  # n_tokens = 200, the wrong K/V
    got = []
    for p in range(PREFIX, len(prompt)):
        rows = m.decode(a, [0, 1], [int(prompt[p])] * 2, [p] * 2, prefixes=[(2, PREFIX)] * 2)
        np.testing.assert_array_equal(rows[0], rows[1])
        got.append(rows[0])
    got = np.stack(got)
    report(f"shared prefix vs float64 reference, {backend}: cosine min {cosines(got, want[PREFIX:]).min():.5f}, "
           f"argmax {(got.argmax(-1) == want[PREFIX:].argmax(-1)).mean():.3f}")
    assert cosines(got, want[PREFIX:]).min() >= 0.995
    assert (got.argmax(-1) == want[PREFIX:].argmax(-1)).mean() >= 0.90


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_equals_reading_a_copy(backend, kv_dtype, report):
    """The same steps with the prefix read from the prefix slot and from each sequence's own copy of it. The prefix
    goes through the tile kernel: on avx2 f32 throughout, so only the order of the additions differs (measured:
    cosine 0.999856 with int8 K/V, 1.000000 with f16 and f32); on vnni/amx its int8 queries and weights move the
    logits as prefill's tile kernel does against decode (test_prefill_then_decode_equals_whole_prefill): the same
    floors."""
    m = model(weights="int4", chunk=8, kv_dtype=kv_dtype, backend=backend, max_batch=4)
    a = arena(m, 4)
    m.prefill(a, 3, rand_prompt(100, seed=3))
    runs = {}
    for shared in (False, True):
        for s in range(3):
            a.copy_slot(s, a, 3)
        steps = []
        for i in range(20):
            toks = [int(t) for t in rand_prompt(4, seed=100 + i)[1:]]
            steps.append(m.decode(a, [0, 1, 2], toks, [100 + i] * 3, prefixes=[(3, 100)] * 3 if shared else None))
        runs[shared] = np.concatenate(steps)
    plain, shared = runs[False], runs[True]
    floor = 0.9995 if backend == "avx2" else {"int8": 0.998, "f16": 0.999, "f32": 0.999}[kv_dtype]
    report(f"shared prefix vs a copy, {backend}, {kv_dtype} K/V: cosine min {cosines(shared, plain).min():.6f}")
    assert cosines(shared, plain).min() >= floor
    top2 = np.sort(plain, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 0.05
    assert clear.mean() >= 0.5 and (shared.argmax(-1) == plain.argmax(-1))[clear].all()


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_a_prefixed_row_does_not_depend_on_its_batch(backend, kv_dtype):
    """Rows naming two different prefixes (one long enough for several parts and tiles), a row with none, and a
    three-token run: decoded together, each gives the bits it gives decoded alone, and the run gives those of its
    tokens one by one."""
    m = model(weights="int4", chunk=8, kv_dtype=kv_dtype, backend=backend, max_batch=8, max_context=600)
    long_prefix, short_prefix = rand_prompt(530, seed=1), rand_prompt(37, seed=2)
    own = [rand_prompt(n, seed=10 + n) for n in (540, 45, 20, 533)]  # slots 0..3; slot 3 carries the run
    prefixes = [(4, 530), (5, 37), None, (4, 530)]

    def fresh():
        a = arena(m, 6)
        m.prefill(a, 4, long_prefix)
        m.prefill(a, 5, short_prefix)
        for s, p in enumerate(own):
            m.prefill(a, s, p)
        return a

    together = fresh()
    slots = [0, 1, 2, 3, 3, 3]
    toks = [7, 8, 9, 10, 11, 12]
    pos = [540, 45, 20, 533, 534, 535]
    batch = m.decode(together, slots, toks, pos, prefixes=[prefixes[s] for s in slots])
    for i, s in enumerate(slots[:4]):
        alone = fresh()
        row = m.decode(alone, [s], [toks[i]], [pos[i]], prefixes=[prefixes[s]])[0]
        np.testing.assert_array_equal(batch[i], row)
    stepwise = fresh()
    for i in (3, 4, 5):
        row = m.decode(stepwise, [3], [toks[i]], [pos[i]], prefixes=[prefixes[3]])[0]
        np.testing.assert_allclose(batch[i], row, rtol=0, atol=EXACT)


def test_bad_prefixes_are_refused_before_anything_is_written():
    m = model(chunk=8, max_context=128, max_batch=4)  # rings of 24 rows
    a = arena(m, 3)
    m.prefill(a, 2, rand_prompt(60, seed=1))
    m.prefill(a, 0, rand_prompt(60, seed=2))
    m.prefill(a, 1, rand_prompt(30, seed=3))
    before = a.checksum(0)
    bad = [
        ([(1, 30)], [1], [30], "prefix slot 1 is written in this step"),
        ([(2, 61)], [0], [60], r"the prefix length must be in \[1, position 60\], got 61"),
        ([(2, 0)], [0], [60], r"must be in \[1, position 60\], got 0"),
        ([(1, 40)], [0], [60], r"prefix slot 1 does not hold positions \[0, 40\).*gap"),
        ([(2, 20)], [0], [60], r"prefix slot 2 does not hold positions \[0, 20\).*no longer holds position"),
        ([(3, 20)], [0], [60], "slot 3 out of range"),
        ([(-2, 20)], [0], [60], "a prefix needs a slot >= 0"),
        ([(2, 60), (2, 59)], [0, 0], [60, 61], "names another prefix than the token before it in its run"),
        ([(2, 60)] * 2, [0], [60], "one entry per token"),
    ]
    for prefixes, slots, positions, message in bad:
        with pytest.raises((ValueError, IndexError), match=message):
            m.decode(a, slots, [5] * len(slots), positions, prefixes=prefixes)
    for entry in [(2,), (2, "60"), 7, "ab"]:
        with pytest.raises(ValueError, match=r"prefixes\[0\] must be None or a pair of integers"):
            m.decode(a, [0], [5], [60], prefixes=[entry])
    assert a.n_tokens(0) == 60 and a.checksum(0) == before
