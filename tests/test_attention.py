"""The tile attention kernels (ops::attend_rows_avx512 on AVX-512 VNNI, ops::attend_rows_avx2 on every AVX2 CPU;
docs/engine-api.md "Prefill attention") against the ymm attend() of ops_avx2.cpp (the reference decode runs),
called one query row at a time on the same cache through the test binding _native.attention_rows.

Stated tolerance, per (row, head) output vector o of a tile kernel against the ymm one r:
  * f16 / f32 K/V, and every cache type on the ymm tile kernel (f32 arithmetic, only the order of the additions
    differs): |o - r| / |r| <= 1e-5 (1e-4 with scores near ±100, where the f32 rounding of a score alone is ~1e-5
    of its weight).
  * int8 K/V on the zmm kernel (int8 query, u8 weights, exact int32 dot products): |o - r| / |r| <= 0.08 for every
    vector, and over all vectors of a case |tiles - ymm| <= 1.5 × |ymm(int8 cache) - ymm(the f32 values it was
    quantised from)|: the kernel's own rounding moves the attention about as far as the int8 cache's rounding does
    (measured on these cases: 0.7-1.3 times; per vector mean 0.6-1.5 %, max 5.2 %, where the cache alone gives max
    5.1 %).
The data: rows of unit-variance elements (as the engine's normed, Hadamard-rotated q/k/v), scores of spread ~3, so
softmaxes run from near-uniform to peaked."""
from __future__ import annotations

import numpy as np
import pytest

from splitgemma import _native as N

VNNI = N.kernels.cpu_supports("vnni")
# The tile kernels: 'tiles_ymm' runs on every host the engine runs on, 'tiles' (zmm) on AVX-512 VNNI CPUs.
TILE_KERNELS = ["tiles_ymm", pytest.param("tiles", marks=pytest.mark.skipif(
    not VNNI, reason="the zmm tile kernel runs on AVX-512 VNNI CPUs (the vnni/amx backends)"))]

FLOAT_TOL = 1e-5
INT8_TOL = 0.08
INT8_VS_CACHE = 1.5


def quantise_rows(x):
    """The int8 K/V cache format (kv_layout.h): per row scale max|x| / 127, round half to even."""
    amax = np.abs(x).max(axis=-1)
    scale = (amax / 127).astype(np.float32)
    codes = np.rint(x / np.where(scale == 0, 1, scale)[..., None]).astype(np.int8)
    return codes, scale


def make_cache(rng, cap, nkv, hd, dtype, spread=3.0):
    k = rng.standard_normal((cap, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((cap, nkv, hd)).astype(np.float32)
    q_scale = spread / np.sqrt(hd)
    if dtype == "int8":
        # One scale per cache row: the kernels take one KV head's scales (nkv = 1 in these cases).
        kc, ks = quantise_rows(k.reshape(cap, -1))
        vc, vs = quantise_rows(v.reshape(cap, -1))
        return dict(k=kc.reshape(k.shape), v=vc.reshape(v.shape), ks=ks, vs=vs), (k, v), q_scale
    np_dtype = np.float16 if dtype == "f16" else np.float32
    return dict(k=k.astype(np_dtype), v=v.astype(np_dtype)), (k, v), q_scale


def rel_err(o, r):
    return np.linalg.norm(o - r, axis=-1) / np.linalg.norm(r, axis=-1)


def case_inputs(dtype, hd, nq, rows, p0, cap):
    """A case's cache (make_cache), the f32 values it holds and its queries, from a seed of the case's shape."""
    rng = np.random.default_rng(hd * 1000 + nq * 100 + rows + p0)
    cache, kv, q_scale = make_cache(rng, cap, 1, hd, dtype)
    return cache, kv, (rng.standard_normal((rows, nq, hd)) * q_scale).astype(np.float32)


def zmm_tiles_in_slices(q, cache, p0, window):
    """The zmm tile kernel over q's rows in slices of at most kAttendRowsVectors vectors (a vector's result does not
    depend on the block it shares), to set beside the AMX kernels' blocks of up to 256."""
    per = max(1, 64 // q.shape[1])
    return np.concatenate([N.attention_rows(q[r:r + per], **cache, kv_head=0, p0=p0 + r, window=window, kernel="tiles")
                           for r in range(0, len(q), per)])


CASES = [
    # (head_dim, nq, rows, p0, window, cap): global causal from position 0 (row 0 sees itself only), rows not dividing
    # the 32-position tile, a window that wraps the ring (cap = window + chunk), chunks starting off the tile grid.
    (256, 8, 8, 0, 0, 64),
    (256, 8, 7, 37, 0, 64),
    (512, 8, 8, 100, 0, 160),
    (512, 2, 21, 300, 0, 400),
    (256, 1, 64, 5, 0, 80),
    (256, 3, 5, 90, 48, 64),
    (256, 8, 8, 123, 40, 56),
    (512, 4, 16, 201, 64, 80),
    (256, 6, 10, 77, 512, 600),
    (512, 5, 12, 31, 16, 28),
]


@pytest.mark.parametrize("kernel", TILE_KERNELS)
@pytest.mark.parametrize("dtype", ["int8", "f16", "f32"])
@pytest.mark.parametrize("hd,nq,rows,p0,window,cap", CASES)
def test_tiles_match_attend(kernel, dtype, hd, nq, rows, p0, window, cap):
    cache, (k, v), q = case_inputs(dtype, hd, nq, rows, p0, cap)
    args = dict(kv_head=0, p0=p0, window=window)
    tiles = N.attention_rows(q, **cache, **args, kernel=kernel)
    ymm = N.attention_rows(q, **cache, **args, kernel="ymm")
    assert np.isfinite(tiles).all()
    err = rel_err(tiles, ymm)
    int8_codes = dtype == "int8" and kernel == "tiles"
    assert err.max() <= (INT8_TOL if int8_codes else FLOAT_TOL), (err.max(), np.unravel_index(err.argmax(), err.shape))
    assert not np.array_equal(tiles, ymm)  # the tile kernel did run (its roundings differ)
    if int8_codes:
        exact = N.attention_rows(q, k, v, **args, kernel="ymm")
        assert np.linalg.norm(tiles - ymm) <= INT8_VS_CACHE * np.linalg.norm(ymm - exact)


@pytest.mark.parametrize("kernel", TILE_KERNELS)
def test_kv_head_offset_and_peaked_softmax(kernel):
    """A second KV head (the head offset into a cache row) and scores of spread ~30 (near one-hot softmaxes, where
    the running maximum's rescaling matters most)."""
    rng = np.random.default_rng(7)
    cap, nkv, hd, rows, nq, p0 = 96, 2, 256, 8, 8, 50
    k = rng.standard_normal((cap, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((cap, nkv, hd)).astype(np.float32)
    q = (rng.standard_normal((rows, nq, hd)) * 30 / np.sqrt(hd)).astype(np.float32)
    for dtype in (np.float16, np.float32):
        for g in range(nkv):
            args = dict(kv_head=g, p0=p0, window=20)
            tiles = N.attention_rows(q, k.astype(dtype), v.astype(dtype), **args, kernel=kernel)
            ymm = N.attention_rows(q, k.astype(dtype), v.astype(dtype), **args, kernel="ymm")
            # Scores near ±100: one f32 rounding of a score is ~1e-5 of a softmax weight (attend_avx512 against
            # attend shows up to 1.2e-5 here, the tile kernel 2.2e-5).
            assert rel_err(tiles, ymm).max() <= 10 * FLOAT_TOL


def test_bad_arguments_are_refused():
    q = np.zeros((4, 2, 256), np.float32)
    k = np.zeros((8, 1, 256), np.float16)
    with pytest.raises(ValueError, match="exceed the ring"):
        N.attention_rows(q, k, k, p0=6)  # positions 0..9 do not fit 8 cache rows
    with pytest.raises(ValueError, match="need ks and vs"):
        N.attention_rows(q, k.astype(np.int8), k.astype(np.int8))
    with pytest.raises(ValueError, match="rows \\* nq"):
        N.attention_rows(np.zeros((40, 2, 256), np.float32), np.zeros((64, 1, 256), np.float16),
                         np.zeros((64, 1, 256), np.float16))
    with pytest.raises(ValueError, match="rows \\* nq"):
        N.attention_rows(np.zeros((40, 2, 256), np.float32), np.zeros((64, 1, 256), np.float16),
                         np.zeros((64, 1, 256), np.float16), kernel="tiles_ymm")
    with pytest.raises(ValueError, match="head_dim % 32"):
        N.attention_rows(np.zeros((4, 2, 48), np.float32), np.zeros((8, 1, 48), np.float16),
                         np.zeros((8, 1, 48), np.float16), kernel="tiles_ymm")
    with pytest.raises(ValueError, match="kernel must be"):
        N.attention_rows(q, k, k, kernel="amx")


AMX_CASES = CASES + [(256, 8, 32, 70, 0, 128), (512, 8, 25, 40, 48, 80)]


@pytest.mark.skipif(not N.kernels.cpu_supports("amx") or not N.kernels.amx_bf16_tiles_usable(),
                    reason="needs AMX-BF16 tiles whose state holds (the amx backend's f16 attention)")
@pytest.mark.parametrize("hd,nq,rows,p0,window,cap", AMX_CASES)
def test_amx_bf16_tiles_match_attend(hd, nq, rows, p0, window, cap):
    """f16 K/V on bf16 tiles (each dot product as five exact bf16 products, docs/engine-api.md): the f32 tolerance
    against the ymm attend(), as the zmm tile kernel; and not the zmm kernel's bits (the tiles did run)."""
    cache, _, q = case_inputs("f16", hd, nq, rows, p0, cap)
    amx = N.attention_rows(q, **cache, kv_head=0, p0=p0, window=window, kernel="tiles_amx")
    ymm = N.attention_rows(q, **cache, kv_head=0, p0=p0, window=window, kernel="ymm")
    assert np.isfinite(amx).all()
    err = rel_err(amx, ymm)
    assert err.max() <= FLOAT_TOL, (err.max(), np.unravel_index(err.argmax(), err.shape))
    assert not np.array_equal(amx, zmm_tiles_in_slices(q, cache, p0, window))


@pytest.mark.skipif(not N.kernels.cpu_supports("amx") or not N.kernels.amx_bf16_tiles_usable(),
                    reason="needs AMX-BF16 tiles whose state holds (the amx backend's f16 attention)")
def test_amx_bf16_tiles_peaked_softmax_and_head_offset():
    """Scores near ±100 (near one-hot softmaxes) and the second KV head, as test_kv_head_offset_and_peaked_softmax:
    the queries' and weights' three bf16 parts keep them to the f32 path's 10x tolerance there."""
    rng = np.random.default_rng(7)
    cap, nkv, hd, rows, nq, p0 = 96, 2, 256, 8, 8, 50
    k = rng.standard_normal((cap, nkv, hd)).astype(np.float16)
    v = rng.standard_normal((cap, nkv, hd)).astype(np.float16)
    q = (rng.standard_normal((rows, nq, hd)) * 30 / np.sqrt(hd)).astype(np.float32)
    for g in range(nkv):
        args = dict(kv_head=g, p0=p0, window=20)
        amx = N.attention_rows(q, k, v, **args, kernel="tiles_amx")
        ymm = N.attention_rows(q, k, v, **args, kernel="ymm")
        assert rel_err(amx, ymm).max() <= 10 * FLOAT_TOL


@pytest.mark.skipif(not N.kernels.cpu_supports("amx") or not N.kernels.amx_tiles_usable(),
                    reason="needs AMX tiles whose state holds (the amx backend's attention)")
@pytest.mark.parametrize("hd,nq,rows,p0,window,cap", AMX_CASES)
def test_amx_tiles_equal_zmm_tiles(hd, nq, rows, p0, window, cap):
    """The int8 path's dot products on AMX tiles give the vpdpbusd loops' exact int32 sums: the same output bits,
    including blocks of more vectors than the zmm kernel takes (kAttendRowsVectorsAmx; a vector's result does not
    depend on the block it shares, so the zmm side runs the rows in slices) and vector counts that are not a multiple
    of the tiles' 16."""
    cache, _, q = case_inputs("int8", hd, nq, rows, p0, cap)
    amx = N.attention_rows(q, **cache, kv_head=0, p0=p0, window=window, kernel="tiles_amx")
    np.testing.assert_array_equal(amx, zmm_tiles_in_slices(q, cache, p0, window))
