"""The native sampler (RowSampler, sample_rows; native/src/engine/row_sampler.h) against an oracle it did not write:
transformers' own logits processors and warpers on fixed rows (tests/fixtures/sampling/processors.npz, made by
tests/tools/make_sampling_fixture.py), and OpenAI's published formula for the presence and frequency penalties,
which transformers has no processor for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from splitgemma.engine import RowSampler, sample, sample_rows

FIXTURE = np.load(Path(__file__).parent / "fixtures" / "sampling" / "processors.npz")
CASES = json.loads(str(FIXTURE["cases"]))
V = FIXTURE["rows"].shape[1]


def sampler_for(case: dict, *, rng_state: int = 7, n_logprobs: int = V) -> RowSampler:
    s = RowSampler(V, temperature=case["temperature"], top_k=case.get("top_k", 0), top_p=case.get("top_p", 1.0),
                   n_logprobs=n_logprobs, min_p=case.get("min_p", 0.0),
                   repetition_penalty=case.get("repetition_penalty", 1.0), min_tokens=case.get("min_tokens", 0),
                   logit_bias={int(k): v for k, v in case.get("logit_bias", {}).items()},
                   stop_ids=case.get("stop_ids", []), prompt_ids=case.get("prompt", [1]), rng_state=rng_state)
    for t in case.get("output", []):
        s.observe(t)
    return s


@pytest.mark.parametrize("i", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_processed_row_and_logprobs_match_transformers(i):
    case, row = CASES[i], FIXTURE["rows"][i]
    logits = row[None, :].copy()
    (s,) = sample_rows(logits, [sampler_for(case)])
    want = FIXTURE["logprobs"][i]
    # the bias and the repetition penalty, as transformers' SequenceBias and RepetitionPenalty processors; the ids
    # min_tokens or min_p exclude hold the lowest float, and transformers excludes them too
    out = logits[0] == np.finfo(np.float32).min
    assert not np.isfinite(want[out]).any()
    np.testing.assert_allclose(logits[0][~out], FIXTURE["processed"][i][~out], rtol=1e-6, atol=1e-6)
    kept = np.flatnonzero(np.isfinite(want))
    # the distribution drawn from: ids, then their logprobs, as transformers' warpers leave it (renormalised)
    got = dict(s.top_logprobs)
    assert sorted(got) == sorted(kept.tolist())
    np.testing.assert_allclose([got[t] for t in kept], want[kept], atol=2e-5)
    assert s.token in got
    if case["temperature"] > 0:
        assert s.logprob == pytest.approx(want[s.token], abs=2e-5)
    else:
        assert s.token == kept[np.argmax(want[kept])]


@pytest.mark.parametrize("presence,frequency", [(0.6, 0.0), (0.0, 0.9), (-1.5, 2.0), (2.0, -0.4)])
def test_presence_and_frequency_follow_openais_formula(presence, frequency):
    # OpenAI (platform docs, "Frequency and presence penalties"):
    #   mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
    # where c[j] is how often token j was sampled before the current position (the prompt is not counted).
    row = FIXTURE["rows"][0]
    output = [3, 3, 3, 10, 20, 20, 95]
    expected = row.astype(np.float64).copy()
    for j in range(V):
        c = output.count(j)
        expected[j] = expected[j] - c * frequency - float(c > 0) * presence
    s = RowSampler(V, temperature=0.0, n_logprobs=V, presence_penalty=presence, frequency_penalty=frequency,
                   prompt_ids=[3, 4, 5])
    for t in output:
        s.observe(t)
    logits = row[None, :].copy()
    (got,) = sample_rows(logits, [s])
    np.testing.assert_allclose(logits[0], expected, rtol=1e-6, atol=1e-6)
    z = expected - expected.max()
    lp = z - np.log(np.exp(z).sum())
    assert got.token == int(np.argmax(expected))
    np.testing.assert_allclose(sorted(lp, reverse=True), [v for _, v in got.top_logprobs], atol=1e-5)


def test_rows_of_one_call_equal_the_rows_alone():
    # Each row its own parameters and history: batching changes nothing, draw for draw.
    def fresh():
        return [sampler_for(c, rng_state=100 + i, n_logprobs=3) for i, c in enumerate(CASES)]

    together = sample_rows(FIXTURE["rows"].copy(), fresh())
    alone = [sample_rows(FIXTURE["rows"][i][None, :].copy(), [s])[0] for i, s in enumerate(fresh())]
    assert together == alone


def test_named_rows_equal_those_rows_alone():
    # rows= samples the rows named (in that order) where they lie, as the decode step's verification does with its
    # logits: the same draws as a copy of those rows, and the rows not named are left as they were.
    pick = [len(CASES) - 1, 0, 2]
    logits = FIXTURE["rows"][:len(CASES)].copy()
    got = sample_rows(logits, [sampler_for(CASES[i], rng_state=200 + i, n_logprobs=2) for i in pick], rows=pick)
    want = sample_rows(FIXTURE["rows"][pick].copy(),
                       [sampler_for(CASES[i], rng_state=200 + i, n_logprobs=2) for i in pick])
    assert got == want
    untouched = [i for i in range(len(CASES)) if i not in pick]
    np.testing.assert_array_equal(logits[untouched], FIXTURE["rows"][untouched])


def test_plain_rows_are_sample():
    # No processing: the same token, logprobs and random state as sample() (the row is not touched).
    rows = FIXTURE["rows"].copy()
    kws = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
           dict(temperature=1.2, top_p=0.5)]
    for kw in kws:
        for i, row in enumerate(rows):
            (s,) = sample_rows(row[None, :].copy(), [RowSampler(V, n_logprobs=4, rng_state=i, **kw)])
            assert s == sample(row, rng_state=i, n_logprobs=4, **kw)


def test_argmax_only_rows():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((4, 1000)).astype(np.float32)
    rows[1, [17, 400, 999]] = rows[1].max() + 1  # ties: the lowest id wins, as sample()'s greedy
    rows[2, :] = -3.0
    for row in rows:
        (fast,) = sample_rows(row[None, :].copy(), [RowSampler(1000, temperature=0, want_logprob=False,
                                                                rng_state=99)])
        ref = sample(row, temperature=0, rng_state=99)
        assert (fast.token, fast.rng_state) == (ref.token, ref.rng_state)  # greedy consumes no draw
    for bad in (np.nan, np.inf, -np.inf):
        row = rows[0].copy()
        row[123] = bad
        (err,) = sample_rows(row[None, :], [RowSampler(1000, temperature=0, want_logprob=False)])
        assert isinstance(err, str) and "NaN or infinity" in err


def test_mask_restricts_and_renormalises():
    row = FIXTURE["rows"][3]
    allowed = [4, 9, 33, 64, 95]
    bits = np.zeros((V + 31) // 32, dtype=np.uint32)
    for t in allowed:
        bits[t // 32] |= np.uint32(1 << (t % 32))
    (s,) = sample_rows(row[None, :].copy(), [RowSampler(V, temperature=1.0, n_logprobs=V, rng_state=5)], [bits])
    z = row[allowed].astype(np.float64)
    lp = z - z.max() - np.log(np.exp(z - z.max()).sum())
    got = dict(s.top_logprobs)
    assert sorted(got) == allowed and s.token in allowed
    np.testing.assert_allclose([got[t] for t in allowed], lp, atol=1e-6)
    # one id allowed: forced, no draw; a stop id held off by min_tokens still ends a constraint with nothing else
    one = np.zeros_like(bits)
    one[0] = 1 << 7
    r = RowSampler(V, temperature=1.0, n_logprobs=2, min_tokens=5, stop_ids=[7], rng_state=5)
    (s,) = sample_rows(row[None, :].copy(), [r], [one])
    assert (s.token, s.rng_state, s.logprob, s.top_logprobs) == (7, 5, 0.0, [(7, 0.0)])
    (err,) = sample_rows(row[None, :].copy(), [r], [np.zeros_like(bits)])
    assert err == "the constraint admits no token here"


def test_a_failing_row_leaves_the_others_and_its_state():
    rows = FIXTURE["rows"][:3].copy()
    rows[1, 5] = np.nan
    samplers = [RowSampler(V, rng_state=i) for i in range(3)]
    out = sample_rows(rows, samplers)
    assert isinstance(out[1], str) and samplers[1].rng_state == 1
    assert out[0] == sample(FIXTURE["rows"][0], rng_state=0) and out[2] == sample(FIXTURE["rows"][2], rng_state=2)


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={V: 1.0}), "outside the vocabulary"), (dict(repetition_penalty=1.1, prompt_ids=[V]), "prompt"),
])
def test_bad_parameters_are_refused_up_front(kw, match):
    with pytest.raises(ValueError, match=match):
        RowSampler(V, **kw)


def test_bad_calls():
    s = RowSampler(V)
    with pytest.raises(ValueError, match="2-D"):
        sample_rows(np.zeros(V, np.float32), [s])
    with pytest.raises(ValueError, match="vocabulary of 96"):
        sample_rows(np.zeros((1, V + 1), np.float32), [s])
    with pytest.raises(ValueError, match="samplers for"):
        sample_rows(np.zeros((2, V), np.float32), [s])
    frozen = np.zeros((1, V), np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        sample_rows(frozen, [s])
    with pytest.raises(ValueError, match="outside logits' 2 rows"):
        sample_rows(np.zeros((2, V), np.float32), [s], rows=[2])
    with pytest.raises(ValueError, match="named twice"):
        sample_rows(np.zeros((2, V), np.float32), [s, RowSampler(V)], rows=[1, 1])
    with pytest.raises(ValueError, match="1 samplers for 2 rows"):
        sample_rows(np.zeros((3, V), np.float32), [s], rows=[0, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.observe(V)


def test_one_id_left_is_forced_without_a_draw():
    row = FIXTURE["rows"][2]
    for kw in (dict(min_p=1.0), dict(min_tokens=1, stop_ids=[t for t in range(V) if t != 40])):
        (s,) = sample_rows(row[None, :].copy(), [RowSampler(V, temperature=1.0, n_logprobs=3, rng_state=11, **kw)])
        want = int(np.argmax(row)) if "min_p" in kw else 40
        assert (s.token, s.rng_state, s.logprob, s.top_logprobs) == (want, 11, 0.0, [(want, 0.0)])


def test_rows_on_a_models_threads_equal_the_rows_in_order():
    # model=: the rows shared out over the model's pool (each under IEEE denormals, as on the caller) give the
    # tokens, logprobs and random states of the call without it; a sampler named twice runs its rows in order.
    from splitgemma.engine import Model
    from test_workers import FGM

    model = Model(str(FGM), threads=2, max_context=64, chunk=16, max_batch=1)

    def fresh():
        return [sampler_for(c, rng_state=300 + i, n_logprobs=3) for i, c in enumerate(CASES)]

    alone = sample_rows(FIXTURE["rows"].copy(), fresh())
    shared = sample_rows(FIXTURE["rows"].copy(), fresh(), model=model)
    assert shared == alone
    rows = np.repeat(FIXTURE["rows"][:1], 3, axis=0)
    one = RowSampler(V, temperature=1.0, rng_state=11)
    got = sample_rows(rows.copy(), [one, one, one], model=model)
    ref = RowSampler(V, temperature=1.0, rng_state=11)
    in_order = [sample_rows(rows[i:i + 1].copy(), [ref])[0] for i in range(3)]
    assert [(g.token, g.logprob) for g in got] == [(r.token, r.logprob) for r in in_order]
    assert one.rng_state == ref.rng_state


def test_best_ids_are_a_full_sorts_first():
    # The top-n ids (ops::best_k_ids: a vector pass against the n-th best so far, and a heap) against numpy's sort:
    # by value, ties to the lower id, on rows full of ties, of +0 and -0 (equal), with the lowest float, and in
    # ascending order (every value enters the heap); n around the share where a partial sort takes over.
    rng = np.random.default_rng(5)
    n = 4096
    zeros = np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32)
    zeros[rng.integers(0, n, 40)] = 0.25
    lowest = rng.standard_normal(n).astype(np.float32)
    lowest[rng.integers(0, n, 300)] = np.finfo(np.float32).min
    rows = [rng.integers(-3, 4, n).astype(np.float32), zeros, lowest,
            np.sort(rng.standard_normal(n)).astype(np.float32)]
    for row in rows:
        order = np.lexsort((np.arange(n), -row.astype(np.float64)))
        for k in (1, 5, 40, 511, n // 8, n // 8 + 1, n):
            g = sample(row, temperature=0, n_logprobs=k)
            assert [t for t, _ in g.top_logprobs] == order[:k].tolist(), k


def test_a_draw_takes_the_first_id_whose_running_total_exceeds_it():
    # Whole-vocabulary sampling: u is the documented SplitMix64 draw, and the token the first id whose running sum of
    # exp((x - max) / T), in id order, exceeds u times the total (here in float64 with numpy's exp and numpy's order of
    # additions: the engine sums in blocks of 64 ids, so only a draw within round-off of a boundary could differ).
    # Lengths past and short of whole blocks and whole vectors, and a row whose mass sits in its last ids.
    from test_engine import splitmix64
    rng = np.random.default_rng(8)
    rows = [(rng.standard_normal(n) * 4).astype(np.float32) for n in (3000, 3003, 61, 7)]
    rows.append(np.linspace(-20, 5, 1001).astype(np.float32))
    for row in rows:
        e = np.exp((row.astype(np.float64) - row.max()) / 0.8)
        running = np.cumsum(e)
        state = 77
        for _ in range(50):
            s = sample(row, temperature=0.8, rng_state=state)
            state, out = splitmix64(state)
            u = (out >> 11) * 2.0**-53
            assert s.rng_state == state
            assert s.token == min(int(np.searchsorted(running, u * running[-1], side="right")), len(row) - 1)
