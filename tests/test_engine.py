"""The native forward pass (splitgemma._native.Model) against oracles we did not write, and its own invariants.

Oracles: fastgemma's mini-e2b / mini-e2b-tame .fgm files with the logits transformers computed from the weights
decoded out of those files (fgm_int4_* / fgm_int8_*), the same kind of references for our own fixtures (converted
by the project's converter, digest-checked by conftest), and the float64 numpy reference (tests/tools/
reference_forward.py, itself checked against transformers) for prompts longer than the fixtures'.
The engine quantises activations and K/V to int8 per row, so it matches those float references only to a
tolerance; the tame file is the one where that tolerance is meaningful (its README: simulated int8 activations
reach cosine >= 0.9993 and full argmax agreement with the int4 file).
Invariants: batching, chunking and prefill+decode give the same numbers as the plain runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import FASTGEMMA, OURS, fastgemma_fgm

from splitgemma import _native as N
from splitgemma.engine import open_arena, sample
from tools.fgm_decode import FgmReader
from tools.reference_forward import forward, text_config

TAME, SHARP = "mini-e2b-tame", "mini-e2b"
WINDOW = 16  # sliding_window of the mini files
EXACT = 1e-5  # "the same numbers": rows never interact, so these runs should agree to float rounding or better
KV_DTYPES = ["int8", "f16", "f32"]  # the K/V cache element types (int8 with a scale per position, f16, f32)


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def model(name=TAME, path=None, **kw):
    kw.setdefault("max_context", 512)
    kw.setdefault("threads", 2)
    return N.Model(path or fastgemma_fgm(name), **kw)


def arena_and_buffer(m, n_slots=1):
    buf = bytearray(m.kv_slot_bytes * n_slots)
    return N.KvArena(m, buf, n_slots), buf


def arena(m, n_slots=1):
    return arena_and_buffer(m, n_slots)[0]


def greedy(m, a, slot, prompt, steps):
    """Prefill then greedy decode through the engine; returns (ids, the logits that chose each)."""
    logits = m.prefill(a, slot, prompt)
    ids, rows = [], []
    pos = len(prompt)
    for _ in range(steps):
        tok = int(np.argmax(logits))
        ids.append(tok)
        rows.append(logits)
        logits = m.decode(a, [slot], [tok], [pos])[0]
        pos += 1
    return np.array(ids), np.stack(rows)


def rand_prompt(n, seed, vocab=1024):
    rng = np.random.default_rng(seed)
    return np.concatenate([[2], rng.integers(3, vocab, n - 1)]).astype(np.int64)


# ------------------------------------------------------------------------------------------------ oracle agreement

# Measured on the sharp mini-e2b (q/k norms ~1 with attention scale 1.0: very sharp attention, so int8 activations
# move logits a lot; fastgemma's README expects argmax agreement ~0.85 for such an engine). The floors sit a small
# margin below what this engine measured: (min cosine, mean cosine, argmax agreement, greedy prefix).
# Since the K/V cache is Hadamard-rotated before its int8 quantisation (kv_layout.h), the logit rms error here is
# unchanged (int4 0.1420 -> 0.1438, int8 0.1518 -> 0.1497) but argmax and greedy prefix over these near-tied
# positions fell (int4 0.850 -> 0.700 and 2 -> 0, int8 0.950 -> 0.875 and 6 -> 0): this fixture's keys are flat
# random vectors, whose int8 error a rotation cannot lower. Real keys have outlier dimensions, where it does (Gemma 3
# 270M, docs/gemma3.md), and the tame and transformers fixtures are as close or closer.
SHARP_MEASURED = {"int4": (0.8941, 0.9844, 0.700, 0), "int8": (0.8976, 0.9831, 0.875, 0)}
SHARP_FLOOR = {"int4": (0.87, 0.980, 0.65, 0), "int8": (0.87, 0.978, 0.80, 0)}


@pytest.mark.parametrize("ffn", ["int4", "int8"])
@pytest.mark.parametrize("name", [TAME, SHARP])
def test_logits_match_fastgemma_reference(name, ffn, backend, report):
    ref = np.load(FASTGEMMA[name] / "reference.npz")
    prompt = ref["prompt_ids"]
    m = model(name, weights=ffn, backend=backend)
    logits = m.prefill(arena(m), 0, prompt, all_logits=True)
    want = ref[f"fgm_{ffn}_logits"]
    assert logits.shape == want.shape and logits.dtype == np.float32
    cos = cosines(logits, want)
    agree = float((logits.argmax(-1) == want.argmax(-1)).mean())
    ids, _ = greedy(m, arena(m), 0, prompt, 8)
    want_ids = ref[f"fgm_{ffn}_greedy_ids"][:8]
    prefix = int(np.argmin(ids == want_ids)) if not np.array_equal(ids, want_ids) else 8
    report(f"engine vs fastgemma {name:14s} {ffn}: cosine min {cos.min():.5f} mean {cos.mean():.5f}, "
           f"argmax {agree:.3f}, greedy prefix {prefix}/8, rms {np.sqrt(((logits - want) ** 2).mean()):.4f}")
    if name == TAME:
        assert cos.min() >= 0.995, f"position {int(cos.argmin())}: cosine {cos.min():.5f}"
        assert agree >= 0.90
        np.testing.assert_array_equal(ids, want_ids)
    else:
        cmin, cmean, amin, pmin = SHARP_FLOOR[ffn]
        assert cos.min() >= cmin and cos.mean() >= cmean and agree >= amin and prefix >= pmin, (
            f"regressed below the measured {SHARP_MEASURED[ffn]}: {cos.min():.4f} {cos.mean():.4f} {agree:.3f} {prefix}")


# Our transformers fixtures (tests/tools/make_fixtures.py), converted by the project's converter: g4-e2b has other KV
# producers than the mini files (sliding 1, full 2), g4-e4b has 2 KV heads (GQA). g4-e2b-sharp has q/k norms ~1, so
# per-position figures swing with the prompt: its floors (mean cosine, argmax agreement over all positions of its
# three prompts) sit a margin below the measured int4 0.961 / 0.687, int8 0.966 / 0.628.
OURS_SHARP_FLOOR = {"int4": (0.950, 0.62), "int8": (0.955, 0.57)}


@pytest.mark.parametrize("ffn", ["int4", "int8"])
@pytest.mark.parametrize("name", sorted(OURS))
def test_logits_match_our_fixtures(name, ffn, converted_fgm, report):
    ref = np.load(OURS[name] / "reference.npz")
    m = model(name, weights=ffn, path=converted_fgm(name))
    all_cos, all_hits = [], []
    for j in range(len(ref["prompt_lengths"])):
        prompt, ids = ref[f"prompt_ids_{j}"], ref[f"fgm_{ffn}_greedy_ids_{j}"]
        want = ref[f"fgm_{ffn}_logits_{j}"]
        got = m.prefill(arena(m), 0, prompt, all_logits=True)
        cos = cosines(got, want)
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        all_cos.append(cos)
        all_hits.append(got.argmax(-1) == want.argmax(-1))
        steps = m.prefill(arena(m), 0, np.concatenate([prompt, ids[:-1]]), all_logits=True)[len(prompt) - 1:]
        hits = steps.argmax(-1) == ids
        # int8 activations and K/V move these logits by up to ~0.06-0.12 (rms ~0.02), so a step whose reference top-2
        # margin is under 0.1 may flip (each fixture's README lists its fragile steps). Only the others must agree,
        # and free-running greedy only up to the first fragile step.
        top2 = np.sort(ref[f"fgm_{ffn}_greedy_step_logits_{j}"], axis=-1)[:, -2:]
        robust = top2[:, 1] - top2[:, 0] >= 0.1
        report(f"engine vs transformers {name:13s} {ffn} prompt {j} ({len(prompt):3d} tokens): cosine min "
               f"{cos.min():.5f} mean {cos.mean():.5f}, argmax {agree:.3f}, teacher-forced greedy "
               f"{hits.mean():.3f} ({hits[robust].mean():.3f} of {robust.sum()} robust steps)")
        if name.endswith("-sharp"):
            continue
        assert cos.min() >= 0.995, f"prompt {j} position {int(cos.argmin())}: cosine {cos.min():.5f}"
        assert agree >= 0.90
        assert hits[robust].all(), f"prompt {j}: robust steps {np.flatnonzero(robust & ~hits)} differ"
        n = min(8, int(np.argmin(robust)) if not robust.all() else 8)
        if n:
            np.testing.assert_array_equal(greedy(m, arena(m), 0, prompt, n)[0], ids[:n])
    if name.endswith("-sharp"):
        mean_cos, agree = float(np.concatenate(all_cos).mean()), float(np.concatenate(all_hits).mean())
        report(f"engine vs transformers {name:13s} {ffn} all prompts: mean cosine {mean_cos:.4f}, argmax {agree:.3f}")
        floor_cos, floor_agree = OURS_SHARP_FLOOR[ffn]
        assert mean_cos >= floor_cos and agree >= floor_agree


def _prompts_and_references(name):
    """[(prompt ids, {key: logits})] of a fixture: one prompt for fastgemma's files, several for ours."""
    ref = np.load((FASTGEMMA | OURS)[name] / "reference.npz")
    if name in FASTGEMMA:
        return [(ref["prompt_ids"], {k: ref[k] for k in ("logits", "fgm_int4_logits", "fgm_int8_logits")})]
    return [(ref[f"prompt_ids_{j}"], {k: ref[f"{k}_{j}"] for k in ("logits", "fgm_int4_logits", "fgm_int8_logits")})
            for j in range(len(ref["prompt_lengths"]))]


def _rms(a, b):
    return float(np.sqrt(((a - b) ** 2).mean()))


@pytest.mark.parametrize("ffn", ["int4", "int8"])
@pytest.mark.parametrize("name", [TAME, SHARP, *sorted(OURS)])
def test_distance_to_the_original_float_weights(name, ffn, converted_fgm, report):
    """The whole distance to transformers on the checkpoint's own weights, split into what the weight quantisation
    costs (transformers on the decoded .fgm weights vs on the originals) and what the engine adds (its int8
    activations and KV cache). On the well-conditioned fixtures the engine's share must stay a small fraction of the
    weight quantisation's; on the sharp ones the figures are reported only."""
    path = fastgemma_fgm(name) if name in FASTGEMMA else converted_fgm(name)
    m = model(name, weights=ffn, path=path)
    total, weights_only, engine_only, hits = [], [], [], []
    for prompt, refs in _prompts_and_references(name):
        got = m.prefill(arena(m), 0, prompt, all_logits=True)
        orig, decoded = refs["logits"], refs[f"fgm_{ffn}_logits"]
        total.append(_rms(got, orig))
        weights_only.append(_rms(decoded, orig))
        engine_only.append(_rms(got, decoded))
        hits.append(got.argmax(-1) == orig.argmax(-1))
    total, weights_only, engine_only = np.mean(total), np.mean(weights_only), np.mean(engine_only)
    agree = float(np.concatenate(hits).mean())
    report(f"engine vs transformers on the ORIGINAL weights {name:14s} {ffn}: logit rms {total:.3f} (weight "
           f"quantisation alone {weights_only:.3f}, engine vs decoded weights {engine_only:.3f}), argmax {agree:.3f}")
    if name not in (SHARP, "g4-e2b-sharp"):
        assert engine_only <= 0.25 * weights_only, (engine_only, weights_only)


@pytest.mark.parametrize("ffn", ["int4", "int8"])
def test_teacher_forced_greedy_steps_match(ffn):
    """Every one of the 16 reference greedy steps (prompt + greedy[:-1] in one prefill) picks the reference token."""
    ref = np.load(FASTGEMMA[TAME] / "reference.npz")
    prompt, ids = ref["prompt_ids"], ref[f"fgm_{ffn}_greedy_ids"]
    m = model(weights=ffn)
    steps = m.prefill(arena(m), 0, np.concatenate([prompt, ids[:-1]]), all_logits=True)[len(prompt) - 1:]
    assert cosines(steps, ref[f"fgm_{ffn}_greedy_step_logits"]).min() >= 0.995
    np.testing.assert_array_equal(steps.argmax(-1), ids)


@pytest.fixture(scope="module")
def long_reference():
    """float64 reference logits of a 300-token prompt (>18 sliding windows) on the int4 weights of the tame file."""
    cfg = text_config(json.loads((FASTGEMMA[TAME] / "config.json").read_text()))
    weights = FgmReader(fastgemma_fgm(TAME)).hf_weights(ffn="int4")
    prompt = rand_prompt(300, seed=7)
    return prompt, forward(weights, cfg, prompt)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("chunk", [8, 256])
def test_long_prompt_through_the_rings(chunk, kv_dtype, long_reference, report):
    """Chunk 8 wraps the 24-row rings every 3 chunks; chunk 256 makes 272-row rings that wrap within the second chunk."""
    prompt, want = long_reference
    m = model(weights="int4", chunk=chunk, kv_dtype=kv_dtype)
    got = m.prefill(arena(m), 0, prompt, all_logits=True)
    cos = cosines(got, want)
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    rms = float(np.sqrt(((got - want) ** 2).mean()))
    report(f"engine vs float64 reference, 300 tokens, chunk {chunk}, {kv_dtype} K/V: cosine min {cos.min():.5f}, "
           f"argmax {agree:.3f}, rms {rms:.4f}")
    assert cos.min() >= 0.995, f"position {int(cos.argmin())}: cosine {cos.min():.5f}"
    assert agree >= 0.90


def test_f16_kv_is_closer_to_the_reference(long_reference):
    """With the weights exact (the reference runs the file's own int4 weights), what remains is the activation and
    K/V quantisation: dropping the K/V part must bring the logits closer."""
    prompt, want = long_reference
    rms = {}
    for kv in KV_DTYPES:
        m = model(weights="int4", kv_dtype=kv)
        assert m.kv_layout["kv_dtype"] == kv
        rms[kv] = float(np.sqrt(((m.prefill(arena(m), 0, prompt, all_logits=True) - want) ** 2).mean()))
    assert rms["f16"] < rms["int8"] and rms["f32"] < rms["int8"], rms


def test_decode_past_the_window_matches_reference(long_reference):
    """Decode steps (one row each) far past the ring capacity read the right ring rows."""
    prompt, want = long_reference
    m = model(weights="int4", chunk=8)
    a = arena(m)
    m.prefill(a, 0, prompt[:200])
    got = np.stack([m.decode(a, [0], [int(prompt[p])], [p])[0] for p in range(200, 300)])
    assert cosines(got, want[200:]).min() >= 0.995
    assert (got.argmax(-1) == want[200:].argmax(-1)).mean() >= 0.90


@pytest.fixture(scope="module")
def q8r_variant(tmp_path_factory):
    """The tame file with both gather tables re-encoded as q8r (int8 row-major, f32 scale = max|row| / 127: the
    layout of fastgemma's --emb-bits 8 / --ple-bits 8), every other blob copied unchanged."""
    from splitgemma.fgm.writer import FgmWriter, TensorEntry

    src = FgmReader(fastgemma_fgm(TAME))
    tables = {}
    for name in ("embed_tokens", "embed_tokens_per_layer"):
        w = src.dequantize(name)
        scale = (np.abs(w).max(axis=1) / 127).astype(np.float32)
        tables[name] = (np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8), scale)
    entries, blobs = [], {}
    for name, t in src.header["tensors"].items():
        base = name[: -len(".scale")] if name.endswith(".scale") else name
        if base in tables:
            codes, scale = tables[base]
            data = scale if name.endswith(".scale") else codes
            entries.append(TensorEntry(name, "f32" if name.endswith(".scale") else "q8r", data.shape, {}))
            blobs[name] = data
        else:
            entries.append(TensorEntry(name, t["dtype"], tuple(t["shape"]), t["meta"]))
            blobs[name] = src.file.raw(name)
    out = tmp_path_factory.mktemp("q8r") / "tame-q8r.fgm"
    with FgmWriter(out) as w:
        w.plan(entries)
        for name, data in blobs.items():
            w.write(name, data)
        w.finish(src.header["config"], {})
    return out


def test_q8r_gather_tables(q8r_variant, report):
    cfg = text_config(json.loads((FASTGEMMA[TAME] / "config.json").read_text()))
    prompt = rand_prompt(60, seed=13)
    want = forward(FgmReader(q8r_variant).hf_weights(ffn="int4"), cfg, prompt)
    m = model(path=q8r_variant, weights="int4")
    got = m.prefill(arena(m), 0, prompt, all_logits=True)
    cos = cosines(got, want)
    report(f"engine vs float64 reference, q8r tables: cosine min {cos.min():.5f}")
    assert cos.min() >= 0.995 and (got.argmax(-1) == want.argmax(-1)).mean() >= 0.90
    # The tables really changed: the q4r file gives different logits.
    q4r = model(weights="int4")
    assert np.abs(got - q4r.prefill(arena(q4r), 0, prompt, all_logits=True)).max() > 1e-3
    with pytest.raises(ValueError, match="different model file"):
        q4r.prefill(arena(m), 0, prompt)


# ---------------------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_chunked_prefill_equals_one_shot(kv_dtype):
    prompt = rand_prompt(120, seed=3)
    out = {}
    for chunk in (8, 256):
        m = model(weights="int4", chunk=chunk, kv_dtype=kv_dtype)
        out[chunk] = m.prefill(arena(m), 0, prompt, all_logits=True)
    np.testing.assert_allclose(out[8], out[256], rtol=0, atol=EXACT)


def test_last_row_shortcut_equals_all_rows():
    """Without all_logits the KV-shared layers run on the last row only (spec §3.5); the result is the same."""
    prompt = rand_prompt(45, seed=4)
    m = model(weights="int4", chunk=16)
    last = m.prefill(arena(m), 0, prompt)
    full = m.prefill(arena(m), 0, prompt, all_logits=True)
    np.testing.assert_allclose(last, full[-1], rtol=0, atol=EXACT)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("name", [TAME, "g4-e4b"])  # MQA, and GQA with 2 KV heads
@pytest.mark.parametrize("backend", ["avx2", "vnni"])
def test_prefill_then_decode_equals_whole_prefill(name, kv_dtype, backend, converted_fgm):
    """Prefill attends through the tile kernel (attend_rows_avx2 / attend_rows_avx512, docs/engine-api.md) and decode
    through attend / attend_avx512: the two agree within the tile kernel's tolerance, carried through the layers. Any
    reassociation of the attention sums can flip an int8 activation code of a later GEMM (a step of 1/127 of the
    row's largest value), and the flips compound: vnni and avx2 runs of g4-e2b differ by 1 - cosine ~2e-4 for that
    reason alone, f32 K/V included. Measured here (vnni): cosine >= 0.99874 for int8 K/V, 0.99955 for f16 and f32
    (g4-e4b, whose first four decoded rows are bit-equal); the top-1 equal on every row whose top-1 leads its top-2
    by 0.05 or more)."""
    if not N.kernels.cpu_supports(backend):
        pytest.skip(f"this CPU cannot run the {backend} backend")
    path = converted_fgm(name) if name in OURS else None
    m = model(name, path=path, weights="int4", chunk=8, kv_dtype=kv_dtype, backend=backend)
    seq = rand_prompt(50, seed=5, vocab=m.vocab_size)
    a = arena(m, 2)
    m.prefill(a, 0, seq[:30])
    stepped = np.stack([m.decode(a, [0], [int(seq[p])], [p])[0] for p in range(30, 50)])
    whole = m.prefill(a, 1, seq, all_logits=True)[30:]
    cos = cosines(stepped, whole).min()
    assert cos >= {"int8": 0.998, "f16": 0.999, "f32": 0.999}[kv_dtype], cos
    top2 = np.sort(whole, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 0.05  # as test_avx512_attention_matches_avx2: leads above the spread
    assert clear.mean() >= 0.5 and (stepped.argmax(-1) == whole.argmax(-1))[clear].all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("max_batch", [8, 2])
def test_batched_decode_equals_each_alone(max_batch, kv_dtype):
    """Three sequences at different positions decoded together (in one pass, or several when max_batch < B) give the
    tokens and logits each gives decoded alone."""
    m = model(max_batch=max_batch, kv_dtype=kv_dtype)
    prompts = [rand_prompt(n, seed=10 + n) for n in (12, 29, 40)]
    together, buf = arena_and_buffer(m, 3)
    toks = [int(np.argmax(m.prefill(together, s, p))) for s, p in enumerate(prompts)]
    pos = [len(p) for p in prompts]
    alone = [N.KvArena(m, bytearray(buf), 3) for _ in range(3)]  # copies of the prefilled slots
    solo_toks, solo_pos = list(toks), list(pos)
    for _ in range(6):
        batch = m.decode(together, [0, 1, 2], toks, pos)
        for s in range(3):
            row = m.decode(alone[s], [s], [solo_toks[s]], [solo_pos[s]])[0]
            np.testing.assert_allclose(batch[s], row, rtol=0, atol=EXACT)
            solo_toks[s], solo_pos[s] = int(np.argmax(row)), solo_pos[s] + 1
        toks, pos = [int(t) for t in batch.argmax(-1)], [p + 1 for p in pos]
        assert toks == solo_toks


def test_decode_into_a_reused_buffer():
    """decode(out=buf) writes the logits into the caller's buffer (its first W rows, returned as a view) and they are
    the logits a fresh result holds; a buffer of the wrong type, width, dtype, layout or too few rows is refused."""
    m = model()
    prompts = [rand_prompt(n, seed=30 + n) for n in (9, 17)]
    fresh, buf = arena_and_buffer(m, 2)
    into = N.KvArena(m, bytearray(buf), 2)
    for s, p in enumerate(prompts):
        m.prefill(fresh, s, p)
        m.prefill(into, s, p)
    out = np.full((5, m.vocab_size), np.nan, np.float32)
    toks, pos = [3, 4], [9, 17]
    for _ in range(3):
        want = m.decode(fresh, [0, 1], toks, pos)
        got = m.decode(into, [0, 1], toks, pos, out=out)
        assert np.shares_memory(got, out) and got.shape == (2, m.vocab_size)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(out[:2], want)
        assert np.isnan(out[2:]).all()  # rows past W untouched
        toks, pos = [int(t) for t in want.argmax(-1)], [p + 1 for p in pos]
    V = m.vocab_size
    for bad, err in ((np.empty((1, V), np.float32), ValueError), (np.empty((2, V + 1), np.float32), ValueError),
                     (np.empty((2, V), np.float64), TypeError), (np.empty((V, 2), np.float32).T, ValueError),
                     (np.empty(2 * V, np.float32), ValueError), ([[0.0] * V] * 2, TypeError)):
        with pytest.raises(err, match="out must be"):
            m.decode(into, [0, 1], toks, pos, out=bad)
    ro = np.empty((2, V), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be"):
        m.decode(into, [0, 1], toks, pos, out=ro)


def test_thread_count_does_not_change_results():
    prompt = rand_prompt(40, seed=6)
    outs = []
    for threads in (1, 2):
        m = model(threads=threads, weights="int8")
        outs.append(m.prefill(arena(m), 0, prompt, all_logits=True))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_weight_policy_selects_twins():
    """auto:M uses the int8 twins for GEMMs with >= M rows: a 20-row prefill under auto:16 equals int8, a 20-row
    prefill under auto:32 equals int4 (and int4 differs from int8)."""
    prompt = rand_prompt(20, seed=8)
    run = {w: model(weights=w).prefill(arena(model()), 0, prompt, all_logits=True) for w in ("int4", "int8")}
    assert np.abs(run["int4"] - run["int8"]).max() > 1e-3
    for w, same in (("auto:16", "int8"), ("auto:32", "int4")):
        m = model(weights=w)
        np.testing.assert_array_equal(m.prefill(arena(m), 0, prompt, all_logits=True), run[same])
    # the policy switched on an open model (splitgemma bench: prefill as the prefill worker, decode as the decoder)
    m = model(weights="int8")
    m.weights = "int4"
    assert m.weights == "int4"
    np.testing.assert_array_equal(m.prefill(arena(m), 0, prompt, all_logits=True), run["int4"])
    with pytest.raises(ValueError, match="auto:M"):
        m.weights = "auto:0"
    assert m.weights == "int4"


# ---------------------------------------------------------------------------------------------- slots and handoff


def test_slot_header_seal_and_verify():
    m = model()
    a, buf = arena_and_buffer(m, 2)
    h = a.header(0)
    assert not h["valid"] and h["n_tokens"] == 0
    m.prefill(a, 0, rand_prompt(20, seed=9))
    h = a.header(0)
    assert h["valid"] and h["n_tokens"] == 20 and not h["sealed"]
    assert h["model_signature"] == m.layout_signature and h["max_context"] == 512 and h["chunk"] == 256
    with pytest.raises(ValueError, match="not sealed"):
        a.verify(0)
    a.seal(0, request_id=77, generation=3)
    a.verify(0, request_id=77, generation=3)
    a.verify(0)
    with pytest.raises(ValueError, match="generation 3 != expected 4"):
        a.verify(0, request_id=77, generation=4)
    with pytest.raises(ValueError, match="request id"):
        a.verify(0, request_id=78, generation=3)
    # Corrupt one K code of layer 0, position 5.
    k_off = m.kv_layout["layers"][0]["k_off"]
    buf[k_off + 5 * m.kv_layout["layers"][0]["row_bytes"]] ^= 1
    with pytest.raises(ValueError, match="checksum mismatch"):
        a.verify(0)
    buf[k_off + 5 * m.kv_layout["layers"][0]["row_bytes"]] ^= 1
    a.verify(0)
    m.decode(a, [0], [5], [20])
    assert a.header(0)["n_tokens"] == 21 and not a.header(0)["sealed"]
    with pytest.raises(ValueError, match="holds no K/V"):
        a.seal(1, 1, 1)
    a.reset(0)
    assert not a.header(0)["valid"]


def test_handoff_between_processes(tmp_path):
    """A second process prefills a prompt into a file-backed shared arena and seals it; this process verifies the
    slot and decodes from it, with the same logits as when it does everything itself."""
    fgm, shm = fastgemma_fgm(TAME), tmp_path / "arena"
    prompt = rand_prompt(37, seed=11)
    np.save(tmp_path / "prompt.npy", prompt)
    child = textwrap.dedent(f"""
        import numpy as np
        from splitgemma._native import Model
        from splitgemma.engine import open_arena
        m = Model({str(fgm)!r}, max_context=512, threads=1)
        a = open_arena(m, 2, {str(shm)!r})
        first = m.prefill(a, 1, np.load({str(tmp_path / "prompt.npy")!r}))
        a.seal(1, request_id=5, generation=9)
        np.save({str(tmp_path / "first.npy")!r}, first)
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    m = model()
    a = open_arena(m, 2, shm)
    a.verify(1, request_id=5, generation=9)
    first = np.load(tmp_path / "first.npy")
    tok = int(np.argmax(first))
    handed = m.decode(a, [1], [tok], [len(prompt)])[0]
    local = arena(m)
    np.testing.assert_allclose(m.prefill(local, 0, prompt), first, rtol=0, atol=EXACT)
    np.testing.assert_allclose(m.decode(local, [0], [tok], [len(prompt)])[0], handed, rtol=0, atol=EXACT)


def test_prefix_reuse_through_copy_slot():
    """A prompt's K/V copied into another arena's slot and extended from there (prefill at pos0 = its length) gives
    the logits of prefilling the whole sequence, at any split point."""
    m = model(weights="int4", chunk=16)
    seq = rand_prompt(70, seed=12)
    whole = m.prefill(arena(m), 0, seq, all_logits=True)
    cache = arena(m, 2)
    m.prefill(cache, 1, seq[:37])
    cache.seal(1, 1, 1)
    target = arena(m, 3)
    target.copy_slot(2, cache, 1)
    assert target.header(2)["n_tokens"] == 37 and not target.header(2)["sealed"]
    np.testing.assert_allclose(m.prefill(target, 2, seq[37:], pos0=37, all_logits=True), whole[37:], rtol=0,
                               atol=EXACT)
    with pytest.raises(ValueError, match="different model or slot geometry"):
        arena(model(chunk=8)).copy_slot(0, cache, 1)


def test_open_arena_anonymous():
    m = model()
    a = open_arena(m, 3)
    assert a.n_slots == 3 and a.slot_bytes == m.kv_slot_bytes
    m.prefill(a, 2, rand_prompt(10, seed=14))
    assert a.n_tokens(2) == 10 and a.n_tokens(0) == 0
    with pytest.raises(ValueError, match="n_slots"):
        open_arena(m, 0)


def test_profile_phases(monkeypatch):
    monkeypatch.setenv("FGM_PROFILE", "1")
    m = model()
    assert m.profiling
    m.prefill(arena(m), 0, rand_prompt(20, seed=15))
    prof = m.profile()
    assert set(prof) == {"embed", "ple", "norms", "act_quant", "qkv_gemm", "qk_rope_kv", "attention", "o_gemm",
                         "ffn_gemm", "ffn_act", "ple_inject", "lm_head"}
    # Layers 0..3 on 20 rows, layers 4..5 on the last row: six attention passes. The GELU runs inside the down
    # projection's activation quantisation (act_quant) when that weight reads int8 activations, as here: ffn_act is
    # timed only when a q8g weight needs the f32 rows written out.
    assert prof["attention"][1] == 6 and prof["ffn_act"] == (0.0, 0)
    assert all(sec > 0 and calls > 0 for name, (sec, calls) in prof.items() if name != "ffn_act")
    m.reset_profile()
    assert all(v == (0.0, 0) for v in m.profile().values())
    monkeypatch.setenv("FGM_PROFILE", "0")
    quiet = model()
    quiet.prefill(arena(quiet), 0, rand_prompt(20, seed=15))
    assert not quiet.profiling and all(v == (0.0, 0) for v in quiet.profile().values())


def test_kv_layout_is_defined_by_config_and_geometry():
    m = model(chunk=8, max_context=100)
    lay = m.kv_layout
    # mini-e2b: layers [s, s, F, s | s, F]; first shared layer 4: layers 0..3 store K/V.
    assert [e["layer"] for e in lay["layers"]] == [0, 1, 2, 3]
    assert [e["cap"] for e in lay["layers"]] == [WINDOW + 8, WINDOW + 8, 100, WINDOW + 8]
    assert [e["row_bytes"] for e in lay["layers"]] == [64, 64, 128, 64]
    assert lay["header_bytes"] == 128 and lay["slot_bytes"] == m.kv_slot_bytes
    for e in lay["layers"]:
        assert all(e[k] % 64 == 0 for k in ("k_off", "v_off", "ks_off", "vs_off"))
    offs = sorted((e[k], e["cap"] * (e["row_bytes"] if k in ("k_off", "v_off") else 4))
                  for e in lay["layers"] for k in ("k_off", "v_off", "ks_off", "vs_off"))
    assert offs[0][0] >= 64 and all(a + n <= b for (a, n), (b, _) in zip(offs, offs[1:]))
    assert offs[-1][0] + offs[-1][1] <= m.kv_slot_bytes
    assert model(chunk=300, max_context=100).kv_layout["layers"][0]["cap"] == 100
    # f16 K/V: rows twice as wide, no scale arrays
    h = model(chunk=8, max_context=100, kv_dtype="f16").kv_layout
    assert h["kv_dtype"] == "f16" and lay["kv_dtype"] == "int8"
    assert [e["row_bytes"] for e in h["layers"]] == [128, 128, 256, 128]
    assert all(e["ks_off"] == e["vs_off"] == 0 for e in h["layers"])
    assert h["slot_bytes"] > lay["slot_bytes"]
    # f32 K/V: the forward pass's own values, four times int8's rows, no scales either
    f = model(chunk=8, max_context=100, kv_dtype="f32").kv_layout
    assert f["kv_dtype"] == "f32" and [e["row_bytes"] for e in f["layers"]] == [256, 256, 512, 256]
    assert all(e["ks_off"] == e["vs_off"] == 0 for e in f["layers"]) and f["slot_bytes"] > h["slot_bytes"]


def test_kv_dtype_mismatch_is_refused():
    """A slot written with one K/V element type is never read as the other: same model and geometry, but the
    header records the type and a reader with the other type refuses the slot."""
    with pytest.raises(ValueError, match="KV cache dtype must be 'int8', 'f16' or 'f32', got 'bf16'"):
        model(kv_dtype="bf16")
    m8, m16 = model(kv_dtype="int8"), model(kv_dtype="f16")
    buf = bytearray(max(m8.kv_slot_bytes, m16.kv_slot_bytes))
    a16 = N.KvArena(m16, buf, 1)
    m16.prefill(a16, 0, rand_prompt(20, seed=2))
    a16.seal(0, 7, 1)
    assert a16.header(0)["kv_dtype"] == "f16"
    a8 = N.KvArena(m8, buf, 1)
    assert not a8.header(0)["valid"]
    with pytest.raises(ValueError, match="f16.*expected.*int8"):
        a8.verify(0, 7, 1)


# ------------------------------------------------------------------------------------------------------ sampling


def splitmix64(state):
    state = (state + 0x9E3779B97F4A7C15) % 2**64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return state, z ^ (z >> 31)


def test_sampling_generator_is_the_documented_splitmix64():
    logits = np.zeros(4, np.float32)  # uniform: token = floor(u * 4)
    state = 12345
    for _ in range(20):
        s = sample(logits, rng_state=state)
        state, out = splitmix64(state)
        assert s.rng_state == state
        assert s.token == int((out >> 11) * 2.0**-53 * 4)


def test_sampling_is_seeded_and_reproducible():
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32) * 3

    def run(seed):
        toks, state = [], seed
        for _ in range(50):
            s = sample(logits, temperature=0.8, top_k=50, top_p=0.9, rng_state=state)
            toks.append(s.token)
            state = s.rng_state
        return toks

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_greedy_equivalents():
    logits = np.random.default_rng(1).normal(size=5000).astype(np.float32)
    best = int(np.argmax(logits))
    g = sample(logits, temperature=0.0, rng_state=9)
    assert g.token == best and g.rng_state == 9  # greedy consumes no draw
    for seed in range(20):
        assert sample(logits, top_k=1, rng_state=seed).token == best
        assert sample(logits, temperature=1e-6, rng_state=seed).token == best
    tie = np.array([1, 3, 3, 0], np.float32)
    assert sample(tie, temperature=0).token == 1


def test_distribution_and_truncation():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05], np.float32))
    n, state = 20000, 3
    counts = {p: np.zeros(5) for p in ("plain", "top_p", "top_k")}
    for _ in range(n):
        for key, kw in (("plain", {}), ("top_p", {"top_p": 0.7}), ("top_k", {"top_k": 3})):
            s = sample(logits, rng_state=state, **kw)
            counts[key][s.token] += 1
        state = s.rng_state
    p = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    tol = 4 * np.sqrt(p * (1 - p) / n)
    assert np.all(np.abs(counts["plain"] / n - p) <= tol)
    # top_p 0.7: the smallest best-first prefix reaching 0.7 is {0, 1}, renormalised.
    assert counts["top_p"][2:].sum() == 0
    assert abs(counts["top_p"][0] / n - 0.4 / 0.7) <= 0.02
    assert counts["top_k"][3:].sum() == 0
    assert abs(counts["top_k"][2] / n - 0.15 / 0.85) <= 0.02


def test_logprobs():
    logits = np.random.default_rng(2).normal(size=300).astype(np.float32) * 2
    lsm = logits - logits.max() - np.log(np.exp(logits.astype(np.float64) - logits.max()).sum())
    g = sample(logits, temperature=0, n_logprobs=5)
    order = np.argsort(-logits)[:5]
    assert [t for t, _ in g.top_logprobs] == list(order)
    np.testing.assert_allclose([lp for _, lp in g.top_logprobs], lsm[order], atol=1e-5)
    np.testing.assert_allclose(g.logprob, lsm[g.token], atol=1e-5)
    # Sampling with top_k=4 at temperature 0.5: the log-softmax of logits/0.5 over the 4 kept tokens.
    s = sample(logits, temperature=0.5, top_k=4, n_logprobs=10, rng_state=1)
    kept = np.argsort(-logits)[:4]
    z = logits[kept].astype(np.float64) / 0.5
    want = z - z.max() - np.log(np.exp(z - z.max()).sum())
    assert [t for t, _ in s.top_logprobs] == list(kept)  # only the kept set is reported
    np.testing.assert_allclose([lp for _, lp in s.top_logprobs], want, atol=1e-5)
    assert s.token in kept and abs(s.logprob - want[list(kept).index(s.token)]) < 1e-5


def test_wide_truncation_keeps_the_full_sort_order():
    """Past 4096 ids the kept set comes from a bucket sort (sampling.cpp BucketOrder), not the heap: it must
    still be a full sort's first ids (by value, ties to the lower id; -0.0 equal to +0.0), which numpy's stable sort
    gives here. A flat row with top_p alone walks up to every id; large top_k takes the bucket path at once."""
    rng = np.random.default_rng(5)
    n = 262144
    flat = (np.round(rng.normal(size=n) * 16) / 16).astype(np.float32)  # many ties
    flat[rng.choice(n, 2000, replace=False)] = -0.0
    flat[rng.choice(n, 2000, replace=False)] = 0.0
    flat[:3] = [-3e38, 3e38 / 2, -1e30]  # a range near float's limit
    order = np.argsort(-flat.astype(np.float64), kind="stable")  # ties keep the lower id first
    for k in (4097, 30000, n - 1):  # the last: every id but one, the zeros among them
        s = sample(flat, top_k=k, n_logprobs=k, rng_state=3)
        assert [t for t, _ in s.top_logprobs] == list(order[:k])
    row = rng.normal(size=n).astype(np.float32)
    order = np.argsort(-row.astype(np.float64), kind="stable")
    w = np.exp(row[order].astype(np.float64) - row.max())
    cum = np.cumsum(w)
    for top_p in (0.3, 0.9):
        s = sample(row, top_p=top_p, n_logprobs=n, rng_state=4)
        kept = [t for t, _ in s.top_logprobs]
        assert kept == list(order[:len(kept)])
        # the smallest prefix that reaches top_p of the mass (to the rounding of the two sums)
        assert cum[len(kept) - 2] < top_p * cum[-1] * (1 + 1e-9) and cum[len(kept) - 1] >= top_p * cum[-1] * (1 - 1e-9)
        assert s.token in set(kept)


def test_sampling_rejects_bad_arguments():
    row = np.zeros(10, np.float32)
    for kw, msg in (({"temperature": -1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                    ({"top_k": -2}, "top_k"), ({"n_logprobs": 11}, "n_logprobs")):
        with pytest.raises(ValueError, match=msg):
            sample(row, **kw)
    with pytest.raises(ValueError, match="NaN"):
        sample(np.array([0, np.nan], np.float32))
    with pytest.raises(ValueError, match="1-D"):
        sample(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="rng_state"):
        sample(row, rng_state=-1)
    with pytest.raises(ValueError, match="rng_state"):
        sample(row, rng_state=2**64)


# ---------------------------------------------------------------------------------------------- input validation


def test_bad_inputs_raise_precise_errors():
    m = model(max_context=64)
    a = arena(m, 2)
    with pytest.raises(IndexError, match=r"tokens\[1\] = 1024 is not a token id in \[0, 1024\)"):
        m.prefill(a, 0, [2, 1024])
    with pytest.raises(IndexError, match="tokens"):
        m.prefill(a, 0, [2, -1])
    with pytest.raises(TypeError, match="integers"):
        m.prefill(a, 0, [2.0, 3.5])
    with pytest.raises(ValueError, match="1-D"):
        m.prefill(a, 0, [[2, 3]])
    with pytest.raises(ValueError, match="at least one token"):
        m.prefill(a, 0, [])
    with pytest.raises(IndexError, match=r"slot 2 out of range \[0, 2\)"):
        m.prefill(a, 2, [2, 3])
    with pytest.raises(ValueError, match="exceed max_context 64"):
        m.prefill(a, 0, np.full(65, 5))
    with pytest.raises(ValueError, match="gap"):
        m.prefill(a, 0, [2, 3], pos0=4)
    m.prefill(a, 0, rand_prompt(60, seed=1))
    with pytest.raises(ValueError, match="exceed max_context"):
        m.decode(a, [0], [5], [64])
    with pytest.raises(ValueError, match="gap"):
        m.decode(a, [0], [5], [61])
    m.prefill(a, 1, [2, 3])
    with pytest.raises(ValueError, match="appears twice"):
        m.decode(a, [1, 1], [5, 6], [2, 2])
    with pytest.raises(ValueError, match="same length"):
        m.decode(a, [0, 1], [5], [60, 2])
    with pytest.raises(IndexError, match="slot"):
        m.decode(a, [7], [5], [0])
    with pytest.raises(ValueError, match="different slot geometry"):
        m.prefill(arena(model(max_context=32)), 0, [2, 3])
    with pytest.raises(ValueError, match="buffer holds"):
        N.KvArena(m, bytearray(m.kv_slot_bytes * 2 - 1), 2)
    with pytest.raises(ValueError, match="writable"):
        N.KvArena(m, bytes(m.kv_slot_bytes), 1)
    with pytest.raises(ValueError, match="n_slots"):
        N.KvArena(m, bytearray(m.kv_slot_bytes), 0)
    with pytest.raises(ValueError, match="weights policy"):
        model(weights="int5")
    with pytest.raises(ValueError, match="auto:M"):
        model(weights="auto:0")
    with pytest.raises(ValueError, match="max_context"):
        model(max_context=0)
    with pytest.raises(ValueError, match="threads"):
        model(threads=0)
    with pytest.raises(ValueError):
        model(backend="sse2")


def test_rewinding_respects_the_rings():
    """Re-decoding from an earlier position is allowed while every ring still holds that position's window."""
    m = model(chunk=8, max_context=128)  # rings of 24 rows
    a = arena(m)
    seq = rand_prompt(60, seed=2)
    m.prefill(a, 0, seq)
    rewound = m.decode(a, [0], [int(seq[55])], [55])[0]  # back 5 (<= chunk): allowed, and equals a fresh run
    fresh = arena(m)
    m.prefill(fresh, 0, seq[:55])
    np.testing.assert_allclose(m.decode(fresh, [0], [int(seq[55])], [55])[0], rewound, rtol=0, atol=EXACT)
    m.prefill(a, 0, seq)
    with pytest.raises(ValueError, match="no longer holds position"):
        m.decode(a, [0], [5], [40])
    m.prefill(a, 0, seq[:10])  # from position 0 a slot can always be rewritten
    assert a.n_tokens(0) == 10


def test_amx_backend_equals_vnni_backend():
    """The amx backend (AMX GEMMs, the prefill attention's int8 dot products on AMX tiles) and the vnni backend give
    the same bits: prefill logits of every row of a prompt long enough for several K/V tiles and attention blocks,
    sliding and full layers, and decode steps after it."""
    if not N.kernels.cpu_supports("amx"):
        pytest.skip("the amx backend cannot run on this CPU")
    prompt = rand_prompt(300, seed=5)
    runs = {}
    for backend in ("amx", "vnni"):
        m = model(backend=backend, kv_dtype="int8")
        a = arena(m)
        logits = m.prefill(a, 0, prompt, all_logits=True)
        steps = [m.decode(a, [0], [int(prompt[i])], [len(prompt) + i])[0] for i in range(3)]
        runs[backend] = np.concatenate([logits, np.stack(steps)])
    np.testing.assert_array_equal(runs["amx"], runs["vnni"])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_avx512_attention_matches_avx2(kv_dtype):
    """The VNNI (and AMX) backends attend with the zmm kernels of ops_avx512.cpp, the AVX2 backend with the ymm ones;
    the GEMMs are bit-identical across backends (test_kernels), so any difference between the two runs is the
    attention's f32 reassociation, carried through the layers, where the int8 rounding of the activations and K/V
    moves a value next to a rounding boundary by one code and so amplifies it (measured on this fixture: cosine
    0.99967-0.99981 between the two after 60 tokens; the largest logit difference 0.055-0.070). Stated tolerance:
    every logit row at cosine >= 0.999, the argmax the same on every row whose top-1 leads its top-2 by 0.05 or more
    (the rows that differ are near-ties: leads of 0.0003-0.03 on this random fixture), and against transformers' logits (the fastgemma reference) each run as close as
    the other (min and mean cosine within 2e-4); and not bit for bit the same, so the zmm path did run."""
    if not N.kernels.cpu_supports("vnni"):
        pytest.skip("the zmm attention runs on the vnni backend, which this CPU cannot run")
    ref = np.load(FASTGEMMA[TAME] / "reference.npz")
    prompt = rand_prompt(60, seed=11)  # 60 > the window of 16: sliding and full layers, a wrapped ring
    runs, vs_ref = {}, {}
    for backend in ("vnni", "avx2"):
        m = model(backend=backend, weights="int8", kv_dtype=kv_dtype)
        a = arena(m)
        logits = m.prefill(a, 0, prompt, all_logits=True)
        steps = [m.decode(a, [0], [int(prompt[i % 7])], [len(prompt) + i])[0] for i in range(4)]
        runs[backend] = np.concatenate([logits, np.stack(steps)])
        c = cosines(m.prefill(arena(m), 0, ref["prompt_ids"], all_logits=True), ref["fgm_int8_logits"])
        vs_ref[backend] = (c.min(), c.mean())
    v, x = runs["vnni"], runs["avx2"]
    assert not np.array_equal(v, x)
    assert cosines(v, x).min() >= 0.999
    top2 = np.sort(x, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= 0.05
    assert clear.mean() > 0.8 and (v.argmax(-1) == x.argmax(-1))[clear].all()
    np.testing.assert_allclose(vs_ref["vnni"], vs_ref["avx2"], rtol=0, atol=2e-4)


def _attend_cache(rng, kv_dtype, cap, hd, heads_in_row):
    """A K/V cache of cap rows holding heads_in_row KV heads of hd elements, as the slot stores it ([cap,
    heads_in_row, hd]: int8 codes with a scale per row, or f16 / f32 values); also the dequantised K and V (float64,
    [cap, heads_in_row * hd]) for the checks."""
    shape = (cap, heads_in_row, hd)
    if kv_dtype == "int8":
        kc = rng.integers(-127, 128, shape).astype(np.int8)
        vc = rng.integers(-127, 128, shape).astype(np.int8)
        ks = rng.uniform(0.004, 0.02, cap).astype(np.float32)
        vs = rng.uniform(0.004, 0.02, cap).astype(np.float32)
        return (kc, vc, ks, vs, kc.reshape(cap, -1) * ks[:, None].astype(np.float64),
                vc.reshape(cap, -1) * vs[:, None].astype(np.float64))
    t = np.float16 if kv_dtype == "f16" else np.float32
    k = rng.standard_normal(shape).astype(t)
    v = rng.standard_normal(shape).astype(t)
    return k, v, None, None, k.reshape(cap, -1).astype(np.float64), v.reshape(cap, -1).astype(np.float64)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attend_row_zmm_matches_ymm(kv_dtype):
    """The zmm attention kernel (ops_avx512.cpp, the vnni backend's decode) against the ymm one (ops_avx2.cpp, the
    reference) on one query row, for every head size whose path differs (64 / 256 / 512: int16 Q.K and P.V on the
    int8 cache; 48: the converting P.V), 1..8 query heads, a run of positions that wraps the ring, a second KV head
    in the row, and tails of 1-3 positions. The zmm kernel attends spans of more than 256 positions in parts (ops.h
    attend_parts: each part with its own int16 weight scale, finer than the span's, folded in f32), so spans of 1-4
    parts are here, and the parts attended one at a time and merged (as single-stream decode hands them to different
    threads) must give the same bits. Stated tolerance: f16 / f32 K/V, f32 reassociation (1e-5 of the
    largest |v|); int8: the queries' int16 rounding (independent, uniform in +-qscale/2) moves score j
    with a standard deviation sigma_j = qscale / sqrt(12) * |k_j|; with every score off by at most 4 max sigma the
    output moves by at most (e^(8 max sigma) - 1) max|v|, and the int16 weights add at most span / 2^16 * max|v|
    (measured: 7-10% of that bound is used). The zmm kernel also matches the float64 definition (the ring mapping)
    to that bound; the ymm one is held to it by test_attend_row_ymm_matches_float64_and_its_parts."""
    if not N.kernels.cpu_supports("vnni"):
        pytest.skip("the zmm attention needs an AVX-512 VNNI CPU")
    for q, k, v, args, kh, ref, vmax in _attend_row_cases(kv_dtype):
        y = N.attention_rows(q[None], k, v, **args, kernel="ymm")[0]
        bound = 1e-5 * vmax
        if kv_dtype == "int8":
            qscale = np.abs(q).max(1) / 16383
            sigma = (qscale[:, None] / np.sqrt(12) * np.linalg.norm(kh, axis=1)[None, :]).max()
            bound += (np.expm1(2 * 4 * sigma) + len(kh) / 65536) * vmax
        z = N.attention_rows(q[None], k, v, **args, kernel="zmm")[0]
        err = np.abs(z - y).max()
        assert err <= bound, (args, q.shape, err, bound)
        np.testing.assert_allclose(z, ref, rtol=0, atol=bound + 1e-5 * vmax)
        np.testing.assert_array_equal(N.attention_rows(q[None], k, v, **args, kernel="zmm", split=True)[0], z)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_attend_row_ymm_matches_float64_and_its_parts(kv_dtype):
    """The ymm attention (ops_avx2.cpp, the avx2 backend's decode) on test_attend_row_zmm_matches_ymm's cases against
    the float64 definition (1e-5 of the largest |v|), and, as the zmm kernel, attending spans of more than 256
    positions in parts: the parts attended one at a time and merged (attend_part, attend_merge_parts_ymm: how
    single-stream decode hands them to different threads) give the bits of the whole call."""
    for q, k, v, args, kh, ref, vmax in _attend_row_cases(kv_dtype):
        y = N.attention_rows(q[None], k, v, **args, kernel="ymm")[0]
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-5 * vmax)
        np.testing.assert_array_equal(N.attention_rows(q[None], k, v, **args, kernel="ymm", split=True)[0], y)


def _attend_row_cases(kv_dtype):
    """One query row of 1-8 heads at position hi attending [lo, hi] (a window of hi - lo + 1 positions) for head
    sizes 64 / 256 / 512 / 48, over a full ring, a window wrapping it (lo % cap > 0, positions past cap) and short odd
    tails, on either KV head of the row: (q, k, v, attention_rows kwargs, the positions' K as float64 [span, hd], the
    float64 attention, max|v|)."""
    rng = np.random.default_rng(21)
    for hd in (64, 256, 512, 48):
        for cap, lo, hi in ((300, 0, 299), (96, 203, 290), (40, 9, 11), (64, 70, 70), (33, 40, 72), (800, 0, 799),
                            (600, 637, 1199)):
            k, v, ks, vs, kf, vf = _attend_cache(rng, kv_dtype, cap, hd, 2)
            for nq in range(1, 9):
                q = (rng.standard_normal((nq, hd)) * (2.0 / np.sqrt(hd) if kv_dtype != "int8" else 0.25))
                q = q.astype(np.float32)
                head = int(rng.integers(0, 2))  # the KV head: the second one starts hd elements into the row
                rows = np.arange(lo, hi + 1) % cap
                kh, vh = kf[rows, head * hd:(head + 1) * hd], vf[rows, head * hd:(head + 1) * hd]
                sc = q.astype(np.float64) @ kh.T
                p = np.exp(sc - sc.max(1, keepdims=True))
                ref = (p / p.sum(1, keepdims=True)) @ vh
                yield q, k, v, dict(ks=ks, vs=vs, kv_head=head, p0=hi, window=hi - lo + 1), kh, ref, np.abs(vh).max()


def _ew_cases(rng):
    """(op, kwargs) cases for N.engine.elementwise on the sizes the models use and ragged ones (tails of 1-15)."""
    cases = []
    for n in (256, 1536, 6144, 8, 24, 37, 131):
        x = (rng.standard_normal(n) * rng.uniform(0.1, 30)).astype(np.float32)
        a = (rng.standard_normal(n) * 3).astype(np.float32)
        w = (1 + rng.standard_normal(n) * 0.2).astype(np.float32)
        cases += [("rmsnorm", dict(x=x, w=w, p0=1e-6)), ("rmsnorm", dict(x=x, p0=1e-6)),
                  ("add_rmsnorm", dict(x=x, a=a, w=w, p0=1e-6)), ("scale", dict(x=x, p0=0.37)),
                  ("gelu_mul", dict(x=x, a=a)), ("softcap", dict(x=x * 4, p0=30.0)),
                  ("ple_mix", dict(x=x, a=a, w=w, p0=0.0255, p1=0.7071, p2=1e-6)),
                  ("quantize_row_i8", dict(x=x)), ("quantize_row_i8", dict(x=np.zeros(n, np.float32))),
                  ("store_row_f16", dict(x=x))]
    for n, block in ((256, 128), (512, 128), (2048, 128), (64, 16), (64, 32), (128, 64), (64, 8), (32, 1)):
        x = rng.standard_normal(n).astype(np.float32)
        cases.append(("fwht_blocks", dict(x=x, block=block)))
    for hd, rot in ((256, 128), (512, 128), (64, 64), (48, 16), (40, 8), (256, 1)):
        ang = rng.uniform(-np.pi, np.pi, hd // 2)
        cs = np.concatenate([np.cos(ang), np.sin(ang)]).astype(np.float32)
        x = (rng.standard_normal(hd) * 5).astype(np.float32)
        cases.append(("head_norm_rope", dict(x=x, w=(1 + rng.standard_normal(hd) * 0.1).astype(np.float32), a=cs,
                                             p0=1e-6, block=rot)))
    return cases


def test_zmm_elementwise_is_bit_identical():
    """The VNNI (and AMX) backends run the element-wise kernels of elementwise_avx512.cpp, the AVX2 backend those of
    ops_avx2.cpp: every op gives the same bits on both (ops.h Elementwise; the reductions keep the ymm association,
    exp/GELU/tanh are the same polynomial, tails are masked or handed to the ymm code). Each output is also checked
    against float64 numpy (a bug shared by both paths would not pass)."""
    if not N.kernels.cpu_supports("vnni"):
        pytest.skip("the zmm element-wise kernels run on the vnni backend, which this CPU cannot run")
    E = N.elementwise
    rng = np.random.default_rng(14)
    for op, kw in _ew_cases(rng):
        y2, y5 = E(op, "avx2", **kw), E(op, "avx512", **kw)
        if op == "quantize_row_i8":
            np.testing.assert_array_equal(y5[0], y2[0], err_msg=op)
            assert y5[1] == y2[1], op
            x = kw["x"].astype(np.float64)
            amax = np.abs(x).max()
            assert y2[1] == np.float32(amax / 127) if amax else y2[1] == 0
            if amax:
                assert np.abs(y2[0] - x / (amax / 127)).max() <= 0.5 + 1e-3
            continue
        np.testing.assert_array_equal(y5, y2, err_msg=f"{op} n={kw['x'].size}")
        x = kw["x"].astype(np.float64)
        if op == "store_row_f16":
            np.testing.assert_array_equal(y2, kw["x"].astype(np.float16).view(np.uint16))
            continue
        a = kw.get("a", np.zeros_like(kw["x"])).astype(np.float64)
        w = kw["w"].astype(np.float64) if "w" in kw else 1.0
        rms = lambda v: v / np.sqrt((v * v).mean() + kw["p0"] if op != "ple_mix" else (v * v).mean() + kw["p2"])
        gelu = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
        if op == "rmsnorm":
            ref = rms(x) * w
        elif op == "add_rmsnorm":
            ref = x + rms(a) * w
        elif op == "scale":
            ref = x * kw["p0"]
        elif op == "gelu_mul":
            ref = gelu(x) * a
        elif op == "softcap":
            ref = kw["p0"] * np.tanh(x / kw["p0"])
        elif op == "ple_mix":
            ref = (rms(x * kw["p0"]) * w + a) * kw["p1"]
        elif op == "fwht_blocks":
            b = kw["block"]
            H = np.array([[1.0]])
            while H.shape[0] < b:
                H = np.block([[H, H], [H, -H]])
            ref = (x.reshape(-1, b) @ H / np.sqrt(b)).reshape(-1)
        else:  # head_norm_rope
            hd, half, b = x.size, x.size // 2, kw["block"]
            v = rms(x) * w
            c, s_ = a[:half], a[half:]
            v = np.concatenate([v[:half] * c - v[half:] * s_, v[half:] * c + v[:half] * s_])
            H = np.array([[1.0]])
            while H.shape[0] < b:
                H = np.block([[H, H], [H, -H]])
            ref = (v.reshape(-1, b) @ H / np.sqrt(b)).reshape(-1)
        np.testing.assert_allclose(y2, ref, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(ref).max()), err_msg=op)


def test_pool_spin_setting(monkeypatch):
    """FGM_POOL_SPIN_US lets the pool's threads spin for the next job before they sleep (threadpool.h): the results
    are the same bits with and without the spin, and a value that is not a microsecond count is refused by name."""
    prompt = rand_prompt(40, seed=6)
    outs = []
    for spin in ("0", "300"):
        monkeypatch.setenv("FGM_POOL_SPIN_US", spin)
        m = model(weights="int4")
        a = arena(m)
        logits = m.prefill(a, 0, prompt, all_logits=True)
        outs.append(np.concatenate([logits, m.decode(a, [0], [3], [len(prompt)])]))
    np.testing.assert_array_equal(outs[0], outs[1])
    for bad in ("-1", "fast", "2000000"):
        monkeypatch.setenv("FGM_POOL_SPIN_US", bad)
        with pytest.raises(ValueError, match="FGM_POOL_SPIN_US"):
            model()
