"""Multi-token decode runs (Model.decode with several tokens of one slot and per-token logits flags) against the
plain one-token-per-sequence decode: the same numbers, byte for byte, and the same K/V (slot checksums).

The oracle here is the engine's plain decode, itself checked against transformers' logits in test_engine.py; what
these tests pin is that a run (a forced-token run, a draft to verify) changes nothing: not the weight encoding
auto:M picks, not the attention path, not the K/V a later step reads, whatever drafts were rejected on the way.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import fastgemma_fgm

from splitgemma import _native as N

TAME = "mini-e2b-tame"
WINDOW = 16  # sliding_window of the mini files
E2B = Path(os.path.expanduser("~/.cache/splitgemma/shared/e2b-random.fgm"))


def rand_seq(n, seed, vocab):
    rng = np.random.default_rng(seed)
    return [2] + [int(t) for t in rng.integers(3, vocab, n - 1)]


@pytest.fixture(scope="session")
def gemma3_tiny(tmp_path_factory):
    """The tiny Gemma 3 (no KV-shared layers, q8g weights with a tied head) converted once."""
    from splitgemma.fgm.convert import convert_checkpoint
    out = tmp_path_factory.mktemp("g3") / "gemma3-tiny.fgm"
    convert_checkpoint(Path(__file__).parent / "fixtures" / "gemma3-tiny", out, weights="int8g", progress=False)
    return out


def fixture_path(name, converted_fgm, gemma3_tiny):
    if name == TAME:
        return fastgemma_fgm(name)
    return gemma3_tiny if name == "gemma3-tiny" else converted_fgm(name)


def plain_steps(m, a, slots, seqs, start, steps):
    """Plain decode of len(slots) sequences together, teacher-forced: logits[t][b] after feeding seqs[b][start+t]."""
    out = []
    for t in range(steps):
        p = start + t
        out.append(m.decode(a, slots, [s[p] for s in seqs], [p] * len(slots)))
    return out


def plain_reference(m, seq, start, steps):
    """(a one-slot arena prefilled with seq[:start] then plain-decoded over the next `steps` tokens, the bytes of
    the prefilled slot, plain decode's logits after each of those tokens)."""
    buf = bytearray(m.kv_slot_bytes)
    plain = N.KvArena(m, buf, 1)
    m.prefill(plain, 0, seq[:start])
    init = bytes(buf)
    return plain, init, [r[0] for r in plain_steps(m, plain, [0], [seq], start, steps)]


def copy_arena(m, buf, n):
    b = bytearray(buf)
    return N.KvArena(m, b, n), b


MODELS = [TAME, "g4-e2b", "gemma3-tiny"]


@pytest.mark.parametrize("name", MODELS)
def test_a_run_equals_plain_decode(name, backend, converted_fgm, gemma3_tiny):
    """One sequence: runs of 1..8 tokens with some logits unflagged give exactly plain decode's rows and K/V; under
    auto:2 a lone sequence's plain decode reads int4, and so does its 8-token run (the policy follows sequences)."""
    m = N.Model(fixture_path(name, converted_fgm, gemma3_tiny), threads=2, max_context=256, chunk=8, weights="auto:2",
                backend=backend)
    seq = rand_seq(80, seed=3, vocab=m.vocab_size)
    plain, init, ref = plain_reference(m, seq, 20, 50)
    multi, _ = copy_arena(m, init, 1)
    p = 20
    rng = np.random.default_rng(0)
    while p < 70:
        n = min(int(rng.integers(1, 9)), 70 - p)
        want = [bool(x) for x in rng.integers(0, 2, n)]
        got = m.decode(multi, [0] * n, seq[p:p + n], list(range(p, p + n)), logits=want)
        assert got.shape == (sum(want), m.vocab_size)
        rows = [ref[p - 20 + j] for j in range(n) if want[j]]
        for g, r in zip(got, rows):
            np.testing.assert_array_equal(g, r)
        p += n
        assert multi.n_tokens(0) == p
    # The plain arena went on to 70 positions as well: the same K/V bytes.
    plain.truncate(0, 70)
    assert multi.checksum(0) == plain.checksum(0)


@pytest.mark.parametrize("name", [TAME, "g4-e2b"])
def test_runs_in_a_batch_equal_the_plain_batch(name, backend, converted_fgm, gemma3_tiny):
    """Three sequences with runs of different lengths in one step equal the plain decode of the same three slots
    (auto:3: the plain batch of 3 reads int8, as the step with 3 sequences and 9 token rows does; a lone sequence
    would read int4, so this also shows the encoding does not follow the token rows)."""
    m = N.Model(fixture_path(name, converted_fgm, gemma3_tiny), threads=2, max_context=256, chunk=8, weights="auto:3",
                backend=backend)
    seqs = [rand_seq(60, seed=10 + i, vocab=m.vocab_size) for i in range(3)]
    buf = bytearray(m.kv_slot_bytes * 3)
    plain = N.KvArena(m, buf, 3)
    for s in range(3):
        m.prefill(plain, s, seqs[s][:16])
    multi, _ = copy_arena(m, buf, 3)
    ref = plain_steps(m, plain, [0, 1, 2], seqs, 16, 6)
    lens = [6, 1, 2]
    slots, toks, pos, want = [], [], [], []
    for s, n in enumerate(lens):
        slots += [s] * n
        toks += seqs[s][16:16 + n]
        pos += list(range(16, 16 + n))
        want += [True] * n
    want[2] = False  # sequence 0's third token: no logits
    got = m.decode(multi, slots, toks, pos, logits=want)
    expect = [ref[j][s] for s, n in enumerate(lens) for j in range(n) if not (s == 0 and j == 2)]
    assert got.shape[0] == len(expect)
    for g, r in zip(got, expect):
        np.testing.assert_array_equal(g, r)
    # ...and differs from the lone sequence's int4 numbers (the test can tell the encodings apart).
    alone, _ = copy_arena(m, buf, 3)
    solo = m.decode(alone, [1], [seqs[1][16]], [16])[0]
    assert np.abs(solo - ref[0][1]).max() > 1e-4


@pytest.mark.parametrize("kv_dtype", ["int8", "f16"])
def test_rejected_drafts_never_corrupt_the_rings(kv_dtype, backend):
    """Speculation's access pattern past the sliding window (16) with rings of window + chunk = 24 rows: each step
    writes the accepted token plus up to 7 drafts, of which a random number are wrong; the next step starts after
    the last accepted one. Every accepted position's logits and the final K/V equal plain decode's."""
    m = N.Model(fastgemma_fgm(TAME), threads=2, max_context=256, chunk=8, weights="int4", backend=backend,
                kv_dtype=kv_dtype)
    seq = rand_seq(150, seed=7, vocab=m.vocab_size)
    _, init, ref = plain_reference(m, seq, 5, 140)
    spec, _ = copy_arena(m, init, 1)
    rng = np.random.default_rng(1)
    p = 5
    while p < 140:
        k = int(rng.integers(0, 8))
        acc = int(rng.integers(0, k + 1))  # drafts 0..acc-1 are right, the rest wrong
        draft = seq[p + 1:p + 1 + acc] + [int(t) for t in rng.integers(3, m.vocab_size, k - acc)]
        run = [seq[p]] + draft
        if p + len(run) > 145:
            break
        got = m.decode(spec, [0] * len(run), run, list(range(p, p + len(run))))
        for j in range(acc + 1):  # rows whose input tokens are all true
            np.testing.assert_array_equal(got[j], ref[p - 5 + j])
        p += acc + 1
        spec.truncate(0, p)
    # A plain run to exactly p positions holds the same K/V in every position a later query reads (the window
    # before p, every layer). Older ring rows may hold rejected drafts: no query reads them (docs/engine-api.md).
    again, _ = copy_arena(m, init, 1)
    plain_steps(m, again, [0], [seq], 5, p - 5)
    lo = p - (WINDOW - 1)
    assert spec.export_positions(0, lo, p) == again.export_positions(0, lo, p)
    # ...and those two slots continue alike, past another window.
    for q in range(p, p + 20):
        tok = seq[q] if q < len(seq) else 3
        np.testing.assert_array_equal(m.decode(spec, [0], [tok], [q]), m.decode(again, [0], [tok], [q]))


def test_unwanted_logits_skip_the_head_and_the_shared_layers(monkeypatch):
    """FGM_PROFILE's call counts: a run with no logits flagged never reaches the LM head and attends only in the
    layers that own K/V; one flagged token brings the head and the shared layers back for that token."""
    monkeypatch.setenv("FGM_PROFILE", "1")
    m = N.Model(fastgemma_fgm(TAME), threads=2, max_context=128, chunk=8)
    a = N.KvArena(m, bytearray(m.kv_slot_bytes), 1)
    m.prefill(a, 0, [2, 5, 6, 7])
    owning = len(m.kv_layout["layers"])  # the layers below first_shared_layer
    assert 0 < owning < m.num_layers  # the fixture has KV-shared layers
    m.reset_profile()
    out = m.decode(a, [0] * 4, [8, 9, 10, 11], [4, 5, 6, 7], logits=[False] * 4)
    assert out.shape == (0, m.vocab_size)
    prof = m.profile()
    assert prof["lm_head"][1] == 0
    assert prof["attention"][1] == owning
    m.reset_profile()
    m.decode(a, [0] * 4, [8, 9, 10, 11], [4, 5, 6, 7], logits=[False, False, False, True])
    prof = m.profile()
    assert prof["lm_head"][1] >= 1
    assert prof["attention"][1] == m.num_layers


def test_bad_runs_are_refused_before_anything_is_written():
    m = N.Model(fastgemma_fgm(TAME), threads=2, max_context=128, chunk=8)
    a = N.KvArena(m, bytearray(m.kv_slot_bytes * 2), 2)
    m.prefill(a, 0, [2, 5, 6, 7])
    m.prefill(a, 1, [2, 5, 6, 7])
    before = a.checksum(0), a.n_tokens(0)
    with pytest.raises(ValueError, match="only a run at consecutive positions"):
        m.decode(a, [0, 0], [3, 4], [4, 6])
    with pytest.raises(ValueError, match="more than the chunk"):
        m.decode(a, [0] * 9, [3] * 9, list(range(4, 13)))
    with pytest.raises(ValueError, match="appears twice"):
        m.decode(a, [0, 1, 0], [3, 3, 3], [4, 4, 4])
    with pytest.raises(ValueError, match="one bool per token"):
        m.decode(a, [0, 0], [3, 4], [4, 5], logits=[True])
    with pytest.raises(ValueError, match="one bool per token"):
        m.decode(a, [0, 0], [3, 4], [4, 5], logits=[1, 0])
    with pytest.raises(IndexError):
        m.decode(a, [0, 0], [3, m.vocab_size], [4, 5])
    with pytest.raises(ValueError, match="truncate"):
        a.truncate(0, 5)
    assert (a.checksum(0), a.n_tokens(0)) == before


@pytest.mark.skipif(not E2B.exists(), reason=f"{E2B} is absent (the full-size random E2B; CI has none)")
def test_full_size_e2b_runs_equal_plain_decode(backend):
    """The same identity on the full-size random E2B (262,144 ids, 35 layers, 20 of them KV-shared, dual int4/int8
    weights under the default auto:16): a forced-style run without logits, then a draft with every row flagged."""
    m = N.Model(E2B, threads=2, max_context=1024, chunk=256, backend=backend)
    seq = rand_seq(100, seed=4, vocab=m.vocab_size)
    plain, init, ref = plain_reference(m, seq, 80, 12)
    multi, _ = copy_arena(m, init, 1)
    got = m.decode(multi, [0] * 4, seq[80:84], list(range(80, 84)), logits=[False, False, False, True])
    np.testing.assert_array_equal(got[0], ref[3])
    got = m.decode(multi, [0] * 8, seq[84:92], list(range(84, 92)))
    for j in range(8):
        np.testing.assert_array_equal(got[j], ref[4 + j])
    assert multi.checksum(0) == plain.checksum(0)
